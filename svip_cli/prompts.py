"""Turning what the user typed into prompt token ids, with an error that names each problem."""

from __future__ import annotations

import json
from pathlib import Path

from svip_common.errors import InvalidRequest


def text_prompt(text: str, where: str = "prompt") -> str:
    """A prompt given as text; Python keeps undecodable argv bytes as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{where} is not valid UTF-8") from None
    if text == "":
        raise InvalidRequest(f"{where} is empty")
    return text


def read_prompt_file(path: str) -> str:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidRequest(f"cannot read prompt file {path!r}: {exc.strerror}") from None
    try:
        return text_prompt(raw.decode("utf-8"), where=f"prompt file {path!r}")
    except UnicodeDecodeError:
        raise InvalidRequest(f"prompt file {path!r} is not valid UTF-8") from None


def parse_id_list(spec: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]."""
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if not items:
        raise InvalidRequest("--prompt-ids is empty")
    ids = []
    for item in items:
        try:
            ids.append(int(item))
        except ValueError:
            raise InvalidRequest(f"--prompt-ids: {item!r} is not an integer") from None
    return ids


def read_input_file(path: str) -> list[str | list[int]]:
    """A JSON Lines batch: one {"prompt": str} or {"prompt_ids": [int, ...]} per line."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidRequest(f"cannot read input file {path!r}: {exc.strerror}") from None
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise InvalidRequest(f"input file {path!r} is not valid UTF-8") from None
    prompts = [_input_line(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise InvalidRequest(f"input file {path!r} holds no prompts")
    return prompts


def _input_line(line: str, where: str) -> str | list[int]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict) or ("prompt" in obj) == ("prompt_ids" in obj):
        raise InvalidRequest(f'{where}: expected an object with exactly one of "prompt", "prompt_ids"')
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise InvalidRequest(f'{where}: "prompt" must be a string')
        return text_prompt(obj["prompt"], where=f"{where}: prompt")
    ids = obj["prompt_ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequest(f'{where}: "prompt_ids" must be a list of integers')
    if not ids:
        raise InvalidRequest(f'{where}: "prompt_ids" is empty')
    return ids
