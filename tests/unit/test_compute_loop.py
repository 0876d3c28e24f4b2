"""The compute thread's plumbing (svip_runtime/compute_loop.py): a burst of sends wakes the event
loop once and arrives in order."""

from __future__ import annotations

import asyncio
import threading

from svip_runtime.compute_loop import Outlet


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
