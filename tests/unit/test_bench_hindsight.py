"""The learnt stop's yardstick (svip_bench/hindsight.py): its ratio over the best fixed method, in
hindsight and held out, on hand-built runs whose numbers are known."""

from __future__ import annotations

import pytest

from svip_bench.hindsight import compare, is_fixed, markdown
from svip_bench.methods import Run


def _run(method: str, category: str, repeat: int, wall: float, tokens: int = 100) -> Run:
    return Run(method, category, "p", repeat, list(range(tokens)), wall, 1, 0)


def _runs(walls: dict[str, tuple[float, float]], category: str = "qa") -> list[Run]:
    return [_run(m, category, rep, w) for m, pair in walls.items() for rep, w in enumerate(pair)]


def test_which_rows_are_fixed_methods():
    fixed = ["constant-4", "heuristic", "confidence", "confidence-0.3", "svip", "svip-0.6", "svip-auto"]
    assert all(map(is_fixed, fixed))
    assert not any(map(is_fixed, ["target", "auto", "defaults", "oracle", "hf-constant-3", "eagle-svip"]))


def test_held_out_picks_on_one_repeat_and_scores_on_the_other():
    # two fixed methods each lucky in one repeat: in hindsight the best one's median is 1.5x, but
    # one picked on a repeat scores 1.0x on the other; auto makes 1.25x in both repeats
    runs = _runs({"target": (1.0, 1.0), "constant-3": (1 / 2.0, 1 / 1.0), "svip": (1 / 1.0, 1 / 2.0),
                  "auto": (1 / 1.25, 1 / 1.25), "oracle": (1 / 9.0, 1 / 9.0)})
    result = compare(runs)
    assert set(result) == {"qa", "all"}
    qa = result["qa"]
    assert qa["best_fixed_speedup"] == pytest.approx(1.5)  # the oracle is not a fixed method
    assert qa["auto"]["in_hindsight"] == pytest.approx(1.25 / 1.5)
    assert qa["auto"]["held_out"] == pytest.approx(1.25)
    assert "defaults" not in qa


def test_one_repeat_has_no_held_out_ratio_and_categories_pool_into_all():
    runs = [*_runs({"target": (1.0,), "constant-2": (0.5,), "auto": (0.4,)}, "qa"),
            *_runs({"target": (1.0,), "constant-2": (1.0,), "auto": (0.5,)}, "rag")]
    result = compare(runs)
    assert result["qa"]["auto"]["held_out"] is None
    assert result["qa"]["auto"]["in_hindsight"] == pytest.approx(2.5 / 2.0)
    # all: 200 tokens in 2 s alone, 1.5 s with constant-2, 0.9 s with auto
    assert result["all"]["auto"]["in_hindsight"] == pytest.approx((200 / 0.9) / (200 / 1.5))
    lines = markdown(result)
    assert any(line.startswith("| all | constant-2 (1.33x) | 1.667 / – | – |") for line in lines)
