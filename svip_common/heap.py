"""The garbage collector in a long-lived process that has loaded models: what it holds once loaded
(modules, the models' Python objects, tokenizer tables: ~400,000 objects in a process holding the
embedded pair) is out of the collector's generations, so a full collection, which comes when the
collector's own counts say and traverses everything tracked, pauses the process for what it
allocated since, not 200-300 ms (measured here) in the middle of a step. In a worker that pause is
a stalled forward for every session in it; on the simulated clock it is that step's host work
(docs/benchmarks.md, the idle forward priced: the same row measured 180 or 255 tokens/s by where
one landed). Nothing is freed that would not be: a frozen object still referenced stays; only
cycles among frozen objects wait until they are unfrozen."""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect once, then move every object the process holds now out of the collector's
    generations (gc.freeze). Call when loading is done and, in a benchmark, before each timed run.
    Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
