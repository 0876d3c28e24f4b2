"""The garbage collector in a long-lived process that has loaded models: what it holds once loaded
(modules, the models' Python objects, tokenizer tables: ~400,000 objects in a process holding the
embedded pair) is out of the collector's generations, so a full collection, which comes when the
collector's own counts say and traverses everything tracked, pauses the process for what it
allocated since, not 200-300 ms (measured here) in the middle of a step. In a worker that pause is
a stalled forward for every session in it; on the simulated clock it is that step's host work
(docs/benchmarks.md, the idle forward priced: the same row measured 180 or 255 tokens/s by where
one landed). Nothing is freed that would not be: a frozen object still referenced stays; only
cycles among frozen objects wait until they are unfrozen: a freeze whose holder ends before the
process does (a timed run, a worker's service that may be started again) is scoped, frozen_heap(),
or what it froze and then dropped in cycles is never freed (a simulated bench that froze each wave's
pair and left it frozen grew by ~15 GB in a run)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_heap() -> int:
    """Collect once, then move every object the process holds now out of the collector's
    generations (gc.freeze). Call when loading is done. Returns how many objects are frozen.
    What it froze and later drops in cycles is not freed until thaw_heap(); a timed run uses
    frozen_heap()."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Back into the collector's oldest generation, everything frozen: what was dropped since is
    freed by the next full collection."""
    gc.unfreeze()


@contextmanager
def frozen_heap() -> Iterator[int]:
    """freeze_heap() for the block's length (a timed run): what it froze is thawed on the way out,
    so the run's own objects are freed once dropped. Yields how many objects are frozen."""
    try:
        yield freeze_heap()
    finally:
        thaw_heap()
