"""The embedded model pair and its feature head, shipped with the package so `svip generate` runs
with no download. svip_assets/pair/MODEL_CARD.md and svip_assets/head/MODEL_CARD.md say how they
were trained and what they measure. Read in any process
that loads the default pair.

May import: svip_common."""

from __future__ import annotations

from pathlib import Path

from svip_common.errors import InvalidRequest, ModelLoadError
from svip_common.knobs import DRAFT_KINDS

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


def check_draft_kind(draft: str | None, kind: str | None) -> None:
    """What a draft kind allows (every surface checks it the same way)."""
    if kind not in (None, *DRAFT_KINDS):
        raise InvalidRequest(f"draft_kind must be one of {', '.join(DRAFT_KINDS)}, got {kind!r}")
    if kind == "eagle" and draft in (None, "none"):
        raise InvalidRequest("draft_kind 'eagle' needs a draft: a feature head's directory or hub id, or 'eagle'")


def check_pair_models(target: str | None, draft: str | None, kind: str | None) -> None:
    """What a surface's target, draft and draft kind may name together (no file is read): no target is the
    embedded pair, whose draft a draft given replaces; a target needs a draft, or 'none'."""
    check_draft_kind(draft, kind)
    if target is not None and draft is None:
        raise InvalidRequest("a target needs a draft: a draft model's directory or hub id, a feature head's, "
                             "or 'none' for the target alone")
    if target is not None and draft == "eagle":
        raise InvalidRequest("draft 'eagle' is the embedded target's feature head; with a target give its head's "
                             "directory")


def pair_paths(target: str | None, draft: str | None, kind: str | None) -> tuple[str, str | None]:
    """(the target, the draft model or feature head, or None: the target alone) as directories or hub
    ids, from what a surface names (a head named by hub id is fetched into the hub cache)."""
    check_pair_models(target, draft, kind)
    if target is None:
        target, embedded = default_pair()
        draft = embedded if draft is None else draft
    head = head_path(draft, kind)
    return target, head if head is not None else None if draft == "none" else draft


def head_path(draft: str | None, kind: str | None = None) -> str | None:
    """The feature head's directory when a draft names one, else None (a draft model, or none).
    'eagle' is the embedded target's own. kind 'model' (or None): a directory whose config.json
    names an EAGLE architecture is a head, anything else a draft model; kind 'eagle': the draft
    must be a head, a directory or a hub id (fetched into the hub cache)."""
    check_draft_kind(draft, kind)
    if draft == "eagle":
        return default_head()
    from svip_common.models import is_feature_head

    if draft is None or draft == "none":
        return None
    if kind != "eagle":
        return draft if is_feature_head(draft) else None
    from svip_common.hub import local_dir

    path = str(local_dir(draft))
    if not is_feature_head(path):
        raise ModelLoadError(f"{draft!r} is not a feature head: its config.json names no EAGLE architecture "
                             "(a draft model is draft kind 'model')")
    return path
