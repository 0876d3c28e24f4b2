"""The compute thread's plumbing (svip_runtime/compute_loop.py): a burst of sends wakes the event
loop once and arrives in order; idle work that waits for a time is called again then, with
nothing posted."""

from __future__ import annotations

import asyncio
import threading

from svip_runtime.compute_loop import ComputeLoop, Outlet


def test_a_burst_of_sends_wakes_the_loop_once_and_keeps_its_order():
    loop = asyncio.new_event_loop()
    try:
        outlet = Outlet(loop)
        wakes = []
        schedule = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), schedule(*a))[1]
        sender = threading.Thread(target=lambda: [outlet.send(i) for i in range(16)])
        sender.start()
        sender.join()
        loop.run_until_complete(asyncio.sleep(0))
        assert len(wakes) == 1 and [outlet.queue.get_nowait() for _ in range(16)] == list(range(16))
        outlet.send("later")  # the burst was taken: the next send wakes the loop again
        loop.run_until_complete(asyncio.sleep(0))
        assert len(wakes) == 2 and outlet.queue.get_nowait() == "later"
        outlet.close()
        outlet.send("after close")
        loop.run_until_complete(asyncio.sleep(0))
        assert outlet.queue.empty() and len(wakes) == 2
    finally:
        loop.close()


def test_idle_work_that_waits_for_a_time_is_called_again_with_nothing_posted():
    """A target step held for blocks about to come (IdleWork.holds_step) returns False from idle()
    and says when to look again (wake_in): the thread calls idle() again then, though nothing is
    posted; with no time named it sleeps until something is."""
    calls, again = [], threading.Event()

    def idle():
        calls.append(len(calls))
        if len(calls) == 2:
            again.set()
        return False

    loop = ComputeLoop("test-compute", idle=idle, wake_in=lambda: 0.0 if len(calls) < 2 else None)
    try:
        assert again.wait(timeout=30)  # a guard against a hang, not the condition: the second call
        done = threading.Event()
        loop.post(done.set)  # after the second call the thread sleeps until this is posted
        assert done.wait(timeout=30)
        assert len(calls) >= 2
    finally:
        loop.stop()
