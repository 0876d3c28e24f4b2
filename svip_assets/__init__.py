"""The embedded model pair and its feature head, shipped with the package so `svip generate` runs
with no download. svip_assets/pair/MODEL_CARD.md and svip_assets/head/MODEL_CARD.md say how they
were trained and what they measure. Read in any process
that loads the default pair.

May import: svip_common."""

from __future__ import annotations

from pathlib import Path

from svip_common.errors import ModelLoadError

PAIR_DIR = Path(__file__).resolve().parent / "pair"
HEAD_DIR = Path(__file__).resolve().parent / "head"  # the embedded target's feature head (`--draft eagle`)
SPLIT_FILE = PAIR_DIR / "split.json"  # which stdlib files were train / validation / test


def default_pair() -> tuple[str, str]:
    """(target directory, draft directory) of the embedded pair."""
    target, draft = PAIR_DIR / "target", PAIR_DIR / "draft"
    if not (target / "config.json").is_file() or not (draft / "config.json").is_file():
        raise ModelLoadError(f"the embedded model pair is missing from {str(PAIR_DIR)!r}; pass --target and --draft")
    return str(target), str(draft)


def default_head() -> str:
    """The directory of the embedded target's feature head (EAGLE-3 layout)."""
    if not (HEAD_DIR / "config.json").is_file():
        raise ModelLoadError(f"the embedded feature head is missing from {str(HEAD_DIR)!r}; pass --draft DIR")
    return str(HEAD_DIR)


def head_path(draft: str | None) -> str | None:
    """The feature head's directory when a draft names one: 'eagle' (the embedded target's own), or
    a directory whose config.json names an EAGLE architecture; None for a draft model (or none)."""
    if draft == "eagle":
        return default_head()
    from svip_common.models import is_feature_head

    return draft if is_feature_head(draft) else None
