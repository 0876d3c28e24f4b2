"""The fault drills' two sizes (tests/drills.py): the bounded form skips the full drill's faults
and names why; an unknown size is refused by name before any test runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import drills

REPO = Path(__file__).resolve().parents[2]


def test_the_full_drills_faults_are_marked_and_the_bounded_ones_are_not():
    params = drills.faults(["target-kill"], ["draft-kill", "draft-stop"])
    assert params[0] == "target-kill"
    assert [p.values[0] for p in params[1:]] == ["draft-kill", "draft-stop"]
    assert all(p.marks == (drills.full_drill,) for p in params[1:])
    skip = drills.full_drill.mark
    assert skip.args == (drills.SIZE != "full",) and "SVIP_DRILLS=full" in skip.kwargs["reason"]


def test_an_unknown_drill_size_is_refused_by_name():
    env = {**os.environ, "SVIP_DRILLS": "huge"}
    run = subprocess.run([sys.executable, "-c", "import tests.drills"], env=env, cwd=REPO, capture_output=True,
                         text=True)
    assert run.returncode != 0
    assert "SVIP_DRILLS='huge': expected one of bounded, full" in run.stderr, run.stderr[-1000:]
