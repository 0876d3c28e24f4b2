"""freeze_heap (svip_common/heap.py): what a process holds once it has loaded its models leaves the
collector's generations, so a full collection later traverses only what came after it; frozen_heap
thaws on the way out, so what a timed run froze is freed once dropped."""

from __future__ import annotations

import gc
import weakref

from svip_common.heap import freeze_heap, frozen_heap


def test_what_is_held_is_frozen_and_a_collection_traverses_only_what_came_after():
    held = [[i] for i in range(1000)]  # tracked containers, alive across the freeze
    try:
        # Other threads in the test process (a gRPC pool, a Ray client) may free frozen objects
        # at any moment, so the count can only be bounded from below.
        assert freeze_heap() >= len(held)
        tracked = {id(o) for o in gc.get_objects()}  # every generation's, not the frozen
        assert not any(id(o) in tracked for o in held)
        later = [[i] for i in range(10)]
        tracked = {id(o) for o in gc.get_objects()}
        assert all(id(o) in tracked for o in later)
        assert held[999] == [999]  # nothing held is lost
    finally:
        gc.unfreeze()  # the test process as it was


class _Cycle:
    def __init__(self):
        self.me = self  # freed by the collector only


def test_a_scoped_freeze_frees_what_it_froze_once_dropped():
    held = _Cycle()
    gone = weakref.ref(held)
    with frozen_heap() as frozen:
        assert frozen >= 1
        del held
        gc.collect()
        assert gone() is not None  # frozen: no collection traverses it
    gc.collect()
    assert gone() is None and gc.get_freeze_count() == 0
