"""Benchmark prompts: Spec-Bench's six categories, plus a `code` category cut from held-out files
of the embedded pair's training corpus (the Python standard library)."""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from svip_common.errors import InvalidRequest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPECBENCH = PROJECT_ROOT.parent / "shared" / "specbench" / "spec-bench.jsonl"
SPECBENCH_CATEGORIES = ("mt-bench", "translation", "summarization", "qa", "math_reasoning", "rag")
CODE = "code"


@dataclass(frozen=True)
class Prompt:
    category: str
    prompt_id: str
    text: str


def specbench_path(explicit: str | None) -> Path:
    return Path(explicit or os.environ.get("SVIP_SPECBENCH") or DEFAULT_SPECBENCH)


def load_specbench(path: Path, per_category: int) -> list[Prompt]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidRequest(
            f"cannot read Spec-Bench prompts at {str(path)!r}: {exc.strerror}; point --dataset at spec-bench.jsonl"
        ) from None
    taken: dict[str, list[Prompt]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            category, qid, text = row["category"], row["question_id"], row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InvalidRequest(f'{path}:{n}: expected {{"question_id", "category", "prompt"}}') from None
        bucket = taken.setdefault(category, [])
        if len(bucket) < per_category:
            bucket.append(Prompt(category, str(qid), text))
    return [p for cat in sorted(taken) for p in taken[cat]]


def load_code_prompts(split_file: Path, per_category: int, context_lines: int = 10) -> list[Prompt]:
    """From each held-out stdlib file: the lines leading up to its first function signature
    that has some context before it; the model writes the body."""
    try:
        held_out = json.loads(split_file.read_text())["test"]
    except (OSError, KeyError, json.JSONDecodeError):
        raise InvalidRequest(f"cannot read the held-out file list at {str(split_file)!r}") from None
    lib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for rel in held_out:
        if len(prompts) >= per_category:
            break
        try:
            lines = (lib / rel).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for i, line in enumerate(lines):
            if i >= context_lines and line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
                prompts.append(Prompt(CODE, rel, "\n".join(lines[i - context_lines : i + 1]) + "\n"))
                break
    return prompts
