"""A Hugging Face hub cache laid out as the hub's own client writes it (models--owner--name with
refs/main and a snapshot), so that hub ids resolve offline (HF_HUB_OFFLINE=1) through the real
huggingface_hub and transformers code, with no network."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def add_repo(hf_home: Path, repo_id: str, source: Path, revision: str | None = None) -> Path:
    """Put ``source``'s files in the cache as ``repo_id`` at one revision (a commit hash; by
    default one made of the id), which becomes its main branch; the snapshot's path."""
    repo = Path(hf_home) / "hub" / f"models--{repo_id.replace('/', '--')}"
    revision = revision or hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in Path(source).iterdir():
        if file.is_file():
            shutil.copyfile(file, snapshot / file.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def offline_env(hf_home: Path, repo_root: str) -> dict[str, str]:
    """A child process's environment: this cache, offline, the checkout importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": repo_root}
