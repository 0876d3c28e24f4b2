"""The learnt stop against the best fixed method in hindsight (issue 41's yardstick), per category.

Fixed methods: every constant k, the heuristic, the confidence stop and SVIP at each setting run
(the small draft's rows; the oracle, `auto`, the defaults and the peers are not fixed methods).

Two ratios, `auto`'s speedup over the best fixed method's:
- ``in_hindsight``: the best picked and scored on the same runs. With n fixed rows whose true
  speeds are equal, the best of n noisy medians sits above all of them, so this ratio is biased
  against any single method, `auto` included (with 17 rows and this machine's spread, by several
  percent).
- ``held_out``: the best picked on one repeat and scored on another (every ordered pair of
  repeats, averaged): what choosing a fixed method in advance from a benchmark would get; the
  fair comparison. None with one repeat.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict

from svip_bench.methods import HEAD_PREFIX, Run

ALL = "all"
FIXED_PREFIXES = ("constant-", "heuristic", "confidence", "svip")
LEARNT = ("auto", "defaults")


def is_fixed(name: str) -> bool:
    return name.startswith(FIXED_PREFIXES) and not name.startswith(HEAD_PREFIX)


def per_repeat_tps(runs: list[Run]) -> dict[int, float]:
    """repeat -> the runs' tokens over their wall time in that repeat."""
    tokens, wall = defaultdict(int), defaultdict(float)
    for r in runs:
        tokens[r.repeat] += len(r.token_ids)
        wall[r.repeat] += r.wall_s
    return {rep: tokens[rep] / wall[rep] for rep in tokens if wall[rep] > 0}


def speedups_by_repeat(runs: list[Run]) -> dict[str, dict[str, dict[int, float]]]:
    """category (and "all") -> method -> repeat -> tokens/s over the target alone's in that repeat."""
    groups: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for r in runs:
        for cat in (r.category, ALL):
            groups[cat, r.method].append(r)
    out: dict = defaultdict(dict)
    for (cat, method), group in groups.items():
        base = per_repeat_tps(groups.get((cat, "target"), []))
        out[cat][method] = {rep: tps / base[rep] for rep, tps in per_repeat_tps(group).items() if base.get(rep)}
    return out


def compare(runs: list[Run]) -> dict:
    """Per category: the best fixed method in hindsight, and for each learnt method present its
    ratio over it, in hindsight and held out."""
    table = speedups_by_repeat(runs)
    result = {}
    for cat in sorted(table, key=lambda c: (c == ALL, c)):
        rows = table[cat]
        fixed = {m: reps for m, reps in rows.items() if is_fixed(m)}
        if not fixed:
            continue
        median = {m: statistics.median(reps.values()) for m, reps in fixed.items()}
        best = max(median, key=median.get)
        entry: dict = {"best_fixed": best, "best_fixed_speedup": median[best]}
        repeats = sorted(set.intersection(*(set(r) for r in fixed.values())))
        for name in LEARNT:
            if name not in rows:
                continue
            learnt = rows[name]
            entry[name] = {"speedup": statistics.median(learnt.values()),
                           "in_hindsight": statistics.median(learnt.values()) / median[best],
                           "held_out": _held_out(fixed, learnt, repeats)}
        result[cat] = entry
    return result


def _held_out(fixed: dict[str, dict[int, float]], learnt: dict[int, float], repeats: list[int]) -> float | None:
    ratios = []
    for pick, score in itertools.permutations(repeats, 2):
        if score not in learnt:
            continue
        chosen = max(fixed, key=lambda m: fixed[m][pick])
        ratios.append(learnt[score] / fixed[chosen][score])
    return statistics.mean(ratios) if ratios else None


def markdown(result: dict) -> list[str]:
    if not result:
        return []
    lines = ["", "The learnt stop over the best fixed method (in hindsight: picked and scored on the same runs; "
             "held out: picked on one repeat, scored on another; svip_bench/hindsight.py):", "",
             "| category | best fixed (speedup) | auto: in hindsight / held out | defaults: in hindsight / held out |",
             "|---|---|---|---|"]
    for cat, entry in result.items():
        cells = []
        for name in LEARNT:
            ratio = entry.get(name)
            cells.append("–" if ratio is None else f"{ratio['in_hindsight']:.3f} / {_fmt(ratio['held_out'])}")
        best = f"{entry['best_fixed']} ({entry['best_fixed_speedup']:.2f}x)"
        lines.append(f"| {cat} | {best} | {cells[0]} | {cells[1]} |")
    return lines


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"
