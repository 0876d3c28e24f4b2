"""Where a model reference lives on this machine: a local directory as it is, a Hugging Face hub id
fetched into the hub cache (HF_HOME; HF_TOKEN for gated or private repositories; HF_HUB_OFFLINE=1
reads the cache alone). The one home for hub downloads that do not go through transformers'
from_pretrained: a feature head's checkpoint, and the target's embedding table that a draft
worker reads without loading the target. Runs in the process that loads the weights (a Serve
replica resolves a head once; the draft worker the target's files)."""

from __future__ import annotations

import os
from pathlib import Path

from svip_common.errors import ModelLoadError

HEAD_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
              "svip_auto_prior.json", "*.md")


def is_local(ref: str) -> bool:
    return Path(ref).exists()


def split_revision(ref: str) -> tuple[str, str | None]:
    """A hub reference pinned to a revision, ``owner/name@revision`` (a commit, tag or branch),
    as (repository, revision); a local path, or a hub id without ``@``, as (ref, None): the
    default branch. Every hub fetch takes the revision, so every pod of a deployment loads the
    same weights (review N6)."""
    if is_local(ref) or "@" not in ref:
        return ref, None
    repo, revision = ref.rsplit("@", 1)
    if not repo or not revision:
        raise ModelLoadError(f"{ref!r}: a pinned hub reference is owner/name@revision")
    return repo, revision


def local_dir(ref: str, patterns: tuple[str, ...] = HEAD_FILES) -> Path:
    """A directory holding ``ref``'s files that match ``patterns`` (a local path as is)."""
    if is_local(ref):
        return Path(ref)
    repo, revision = split_revision(ref)
    _check_hub_id(repo)
    from huggingface_hub import snapshot_download

    return Path(_from_hub(ref, lambda: snapshot_download(repo, revision=revision, allow_patterns=list(patterns))))


def local_file(ref: str, name: str) -> Path | None:
    """``name`` inside ``ref`` on this machine (downloaded from the hub for a hub id); None when
    the checkpoint has no such file."""
    if Path(name).is_absolute() or ".." in Path(name).parts:  # a name from an index file: never outside
        raise ModelLoadError(f"{ref!r}: the file name {name!r} leaves the checkpoint")
    if is_local(ref):
        path = Path(ref) / name
        return path if path.is_file() else None
    repo, revision = split_revision(ref)
    _check_hub_id(repo)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    def fetch():
        try:
            return hf_hub_download(repo, name, revision=revision)
        except EntryNotFoundError:
            return None  # the repository is there; the file is not
        except LocalEntryNotFoundError:
            if _cached_repo(repo):  # offline, the cache holds the repository but not this file
                return None
            raise

    found = _from_hub(ref, fetch)
    return None if found is None else Path(found)


def looks_like_local_path(ref: str) -> bool:
    """Hub ids are 'name' or 'owner/name'; anything else is meant as a directory."""
    return os.path.isabs(ref) or ref.startswith((".", "~")) or ref.count("/") > 1 or os.path.exists(ref)


def _check_hub_id(ref: str) -> None:
    """A reference that can only be a path and is missing: one line."""
    if looks_like_local_path(ref):
        raise ModelLoadError(f"{ref!r}: no such directory (a hub id has the form owner/name)")


def _from_hub(ref: str, fetch):
    """Run a hub fetch; its failures become one line naming the reference."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return fetch()
    except RepositoryNotFoundError as exc:
        raise ModelLoadError(f"{ref!r}: no such directory, and no such hub repository (or no access to it: "
                             "set HF_TOKEN for a gated or private one)") from exc
    except LocalEntryNotFoundError as exc:
        raise ModelLoadError(f"{ref!r}: no such directory, and not in the hub cache (offline, or the hub "
                             "cannot be reached)") from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{ref!r}: cannot fetch it from the hub ({first})") from exc


def _cached_repo(ref: str) -> bool:
    """Whether the hub cache holds a snapshot of ``ref`` (offline: a missing file is then missing)."""
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / f"models--{ref.replace('/', '--')}" / "snapshots"
    return folder.is_dir() and any(folder.iterdir())
