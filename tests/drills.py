"""Fault drills in two sizes. CI (README's test command) runs the bounded form: one fault of each
kind per layer (a draft SIGKILL and a target SIGKILL at the engine, a target SIGKILL through
`svip serve`, every fault through `svip generate --mode distributed`, workers lost for good). The
full form, `SVIP_DRILLS=full .venv/bin/python -m pytest -q -m drill`, adds every other fault at
every layer (a draft SIGSTOP at the engine, draft faults through Serve, a greedy target kill and a
sampled draft kill at the engine)."""

from __future__ import annotations

import os

import pytest

SIZES = ("bounded", "full")
SIZE = os.environ.get("SVIP_DRILLS", "bounded")
if SIZE not in SIZES:
    raise pytest.UsageError(f"SVIP_DRILLS={SIZE!r}: expected one of {', '.join(SIZES)}")

full_drill = pytest.mark.skipif(SIZE != "full", reason="full fault drill (SVIP_DRILLS=full runs it)")


def faults(bounded: list[str], full: list[str]) -> list:
    """Parameters for a drill over faults: the bounded ones always, the rest only in the full drill."""
    return [*bounded, *(pytest.param(f, marks=full_drill) for f in full)]
