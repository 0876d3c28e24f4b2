"""training/feature_head.py on the embedded target, in a few seconds: it writes a head in the
published layout that loads against the target, its validation agreement beside the small
draft's, and a rerun resumes from its checkpoint instead of starting over."""

from __future__ import annotations

import json

import pytest

from draft_worker.feature_head import load_head
from svip_assets import default_pair
from training import feature_head

pytestmark = pytest.mark.system  # the second tier (pyproject.toml markers)


def run(out, budget: float, capsys) -> tuple[dict, str]:
    args = ["--out", str(out), "--train-s", str(budget), "--batch", "2", "--seq-len", "16", "--eval-windows", "2",
            "--texts", "12", "--threads", "1"]
    assert feature_head.main(args) == 0
    printed = capsys.readouterr().out
    return json.loads((out / "metrics.json").read_text()), printed


def test_a_head_is_trained_saved_and_resumed(tmp_path, capsys):
    from transformers import AutoConfig

    out = tmp_path / "head"
    first, _ = run(out, 2.0, capsys)
    assert first["steps"] >= 1 and first["tokens_seen"] == first["steps"] * 2 * 16
    validation = first["validation"]
    assert validation["positions"] == 2 * 15
    for key in ("head_first_token", "head_second_token", "small_draft"):
        assert 0.0 <= validation[key] <= 1.0
    head = load_head(out, AutoConfig.from_pretrained(default_pair()[0]))
    assert head.config.target_layers == (2, 5, 9)
    # train_s is the time spent rounded to 0.1 s: 0.1 less is a budget already spent, 0.5 more is not
    again, printed = run(out, first["train_s"] - 0.1, capsys)  # the budget is spent: it resumes and stops
    assert "resumed at step" in printed and again["steps"] == first["steps"]
    more, _ = run(out, first["train_s"] + 0.5, capsys)  # a larger budget: it goes on from there
    assert more["steps"] > first["steps"]
