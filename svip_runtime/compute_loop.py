"""The compute thread a worker's state lives on.

A worker splits its work between two threads: the asyncio event loop does I/O only (gRPC reads
and writes), and one compute thread owns every session and the model. Messages cross once each
way: the loop posts what it read (``post``), the thread handles it in arrival order and hands
what it wants sent back to the loop (``Outlet.send``). Between messages the thread runs idle
work in small units (a draft forward at a time), so a message that arrives never waits for more
than one unit.

Work that one request chose and that takes long (compiling its grammar) never runs on the compute
thread: ``aside(fn, then)`` runs fn on the loop's aside thread and posts then(its future) back,
so every other session keeps stepping meanwhile.

The compute thread wakes the event loop once per burst of sends, not once per message. (Running it
at a lower priority than the I/O threads, nice +10, was measured and left out: no change in the
round's transit or overhead on this 2-core machine, see docs/benchmarks.md.)
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
_STOP = object()


class ComputeLoop:
    def __init__(self, name: str, idle: Callable[[], bool] | None = None,
                 wake_in: Callable[[], float | None] | None = None):
        """idle(): called while no item waits; does one unit of work and returns True, or False
        when there is nothing to do (the thread then sleeps until something is posted, or for
        wake_in()'s seconds where it says when idle() will have work: None, until posted)."""
        self._idle, self._wake_in = idle, wake_in
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._aside = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{name}-aside")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, fn: Callable[..., object], *args) -> None:
        """From any thread: call fn(*args) on the compute thread, after what was posted before."""
        self._inbox.put((fn, args))

    def aside(self, fn: Callable[[], object], then: Callable[[concurrent.futures.Future], object]) -> None:
        """Run fn() off the compute thread (one at a time, in order), then post then(its future)."""
        self._aside.submit(fn).add_done_callback(lambda future: self.post(then, future))

    def stop(self) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout=10)
        self._aside.shutdown(wait=False, cancel_futures=True)

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                if self._idle is not None and self._guard(self._idle):
                    continue
                try:
                    item = self._inbox.get(timeout=self._wake_in() if self._wake_in is not None else None)
                except queue.Empty:  # idle() has work now
                    continue
            if item is _STOP:
                return
            self._guard(item[0], *item[1])

    @staticmethod
    def _guard(fn, *args):
        try:
            return fn(*args)
        except Exception:  # handlers report their own errors; this keeps the thread alive
            log.exception("compute loop: unhandled error")
            return False


class ManualLoop:
    """The compute thread's inbox, run by its caller instead of a thread (the in-memory transport,
    coordinator/in_memory.py): the same order as ``ComputeLoop``: what was posted runs in order,
    and idle work only while nothing waits. ``run_idle`` can deliver what arrived while its unit
    ran (a block that reached the target during its forward) ahead of what the unit posted."""

    def __init__(self, name: str, idle: Callable[[], bool] | None = None,
                 wake_in: Callable[[], float | None] | None = None):
        """An error that a handler lets escape is raised to the caller (a test sees the bug), where
        the thread's loop logs it and goes on. wake_in: as ComputeLoop's; its caller reads it
        (``wake_in``) and runs time itself."""
        self.name = name
        self._idle, self._wake_in = idle, wake_in
        self.inbox: collections.deque = collections.deque()
        self._during: list | None = None  # while idle work runs: what it posts
        self.held: list = []  # what a held unit posted (run_idle's hold)

    def post(self, fn: Callable[..., object], *args) -> None:
        (self._during if self._during is not None else self.inbox).append((fn, args))

    def aside(self, fn: Callable[[], object], then: Callable[[concurrent.futures.Future], object]) -> None:
        """As ComputeLoop's, in order with what is posted: fn runs when the item it posts is run."""
        self.post(lambda: then(_future_of(fn)))

    def stop(self) -> None:
        self.inbox.clear()

    def on_thread(self) -> bool:
        return True

    def wake_in(self) -> float | None:
        """The seconds until idle() has work though nothing is posted (None: not until posted)."""
        return self._wake_in() if self._wake_in is not None else None

    def run_one(self) -> None:
        """Run the oldest posted item (there is one: see ``inbox``)."""
        fn, args = self.inbox.popleft()
        fn(*args)

    def run_idle(self, meanwhile: Callable[[], None] | None = None, hold: bool = False) -> bool:
        """One unit of idle work (call it only while the inbox is empty); meanwhile(): posts what
        arrived during the unit, which runs before what the unit itself posted; hold: keep what
        the unit posted in ``held`` until ``release`` (a simulated device finishes the unit later,
        and what arrives until then comes first). Returns whether the unit did anything."""
        if self._idle is None:
            return False
        self._during = []
        try:
            did = bool(self._idle())
        finally:
            own, self._during = self._during, None
        if meanwhile is not None:
            meanwhile()
        if hold:
            self.held = own
        else:
            self.inbox.extend(own)
        return did

    def release(self) -> None:
        """What the last held unit posted joins the inbox, after what arrived meanwhile."""
        self.inbox.extend(self.held)
        self.held = []


def _future_of(fn: Callable[[], object]) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(fn())
    except Exception as exc:  # noqa: BLE001 - handed to whoever reads the future
        future.set_exception(exc)
    return future


class Outlet:
    """What the compute thread sends through the event loop: ``send(item)`` is thread-safe and
    puts ``item`` on an asyncio queue that the loop drains (a gRPC stream's writer), in order.
    Sends made while the loop has not yet taken the earlier ones cost no further wake-up: a step
    that emits to sixteen sessions wakes the loop once."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self._lock = threading.Lock()
        self._pending: list = []  # sent, not yet on the queue (a wake-up is scheduled for them)

    def send(self, item) -> None:
        if self.closed:
            return
        with self._lock:
            self._pending.append(item)
            if len(self._pending) > 1:  # the wake-up scheduled for the first one takes this one too
                return
        self.loop.call_soon_threadsafe(self._deliver)

    @property
    def waiting(self) -> int:
        """Items sent and not yet taken from the queue: those on it and those still on their way to
        it (a sender's items reach the queue only when the loop runs its wake-up)."""
        return self.queue.qsize() + len(self._pending)

    def _deliver(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        for item in items:
            self.queue.put_nowait(item)

    def close(self) -> None:
        self.closed = True
