"""The compute thread's plumbing (svip_runtime/compute_loop.py): a burst of sends wakes the event
loop once and arrives in order; the compute thread runs below the I/O threads' priority."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from svip_runtime.compute_loop import ComputeLoop, Outlet, lower_priority


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_the_compute_thread_runs_below_the_threads_that_do_io():
    process = os.getpriority(os.PRIO_PROCESS, 0)
    seen = threading.Event()
    nice = []
    compute = ComputeLoop("test-compute")
    try:
        compute.post(lambda: (nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())), seen.set()))
        assert seen.wait(60)
    finally:
        compute.stop()
    assert nice == [min(19, process + 10)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == process  # only its own thread


def test_lower_priority_of_zero_leaves_the_thread_as_it_is():
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    lower_priority(0)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
