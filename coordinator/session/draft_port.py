"""The target worker's way to its draft worker, one that outlives the draft: the current
``DraftLink`` (coordinator/session/draft_link.py), the draft's Ray actor to get a replacement from, and what
the stall deadlines follow.

When the link breaks (the draft's process died) the sessions are told at once (``on_lost``, they
go on without it) and, where the draft is a Ray actor with restarts left, the port asks it for its
address again: Ray restarts a dead actor, and its ``serve()`` loads the weights and serves again.
The new link opens and the sessions are told (``on_back``, they re-attach). The port keeps asking,
backing off, for as long as the draft's actor lives (each ask bounded by the recovery deadline);
meanwhile the sessions go on with the target alone, never an error. A draft whose process is up
but whose compute thread is stuck (its Stats probe fails) is killed, so Ray replaces it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from coordinator.session.draft_link import DraftLink
from svip_common.errors import WorkerUnavailable
from svip_common.knobs import default
from svip_common.messages import DraftRequest
from svip_common.step_cost import Ewma
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_runtime.actor import WorkerGone, serving_address
from svip_runtime.grpc_server import draft_stats
from svip_runtime.tls import TlsFiles

log = logging.getLogger(__name__)

STALL_FACTOR = 10.0  # a draft that takes this many times its usual answer time is stalled
DEFAULT_STALL_S = default("draft_stall_s")  # ...and never less than this (a first block carries the prompt's prefill)
DEFAULT_RECOVER_S = default("worker_start_timeout_s")  # one ask for a replaced draft may take as long as a start
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 30.0  # the pause between asks, doubling up to the most
PROBE_EVERY_S = 15.0  # how often a connected draft's compute thread is probed
_EWMA = 0.1


class DraftPort:
    def __init__(self, address: str | None, actor, on_event: Callable[[pb.DraftEvent, float, int], None],
                 on_lost: Callable[[str], None], on_back: Callable[[], None], tls: TlsFiles | None = None,
                 stall_s: float = DEFAULT_STALL_S, recover_s: float = DEFAULT_RECOVER_S, link=None):
        """address: the draft worker's (None: ask the actor); actor: its Ray actor handle (None:
        no replacement can be had). on_lost(reason) / on_back() are called on the event loop.
        link: one already open (the in-memory transport's: ``send(session_id, data)`` and
        ``broken``); open() then connects nothing."""
        self.address, self.actor, self._tls = address, actor, tls
        self._on_event, self._on_lost, self._on_back = on_event, on_lost, on_back
        self.stall_s, self.recover_s = stall_s, recover_s
        self.link: DraftLink | None = link
        self.lost: str | None = None  # why no draft is connected now
        self.replacements = 0  # links opened to a replaced draft worker
        self._answer_s = Ewma(_EWMA)
        self._recovery: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None

    async def open(self) -> None:
        """Connect to the draft; one that cannot be reached now (being replaced) is recovered in
        the background while the target serves alone."""
        if self.link is not None:
            return
        try:
            if self.address is None:
                self.address = await serving_address(self.actor, "draft", self.recover_s)
            link = self._link(self.address)
            await link.open()
        except WorkerUnavailable as exc:
            if self.actor is None:
                raise
            self.broke(str(exc))
            return
        finally:
            if self.actor is not None and self._watch is None:
                self._watch = asyncio.get_running_loop().create_task(self.watch())
        self.link = link

    def _link(self, address: str) -> DraftLink:
        return DraftLink(address, self._on_event, self.broke, self._tls)

    async def close(self) -> None:
        for task in (self._recovery, self._watch):
            if task is not None:
                task.cancel()
        if self.link is not None:
            await self.link.close()

    # --- from the compute thread ------------------------------------------------------------------

    def send(self, session_id: str, request: DraftRequest) -> int:
        """The session's request onto the wire (converted here, its edge): the bytes sent, 0 when no
        draft is connected (the sessions are detached: nothing to send)."""
        if not self.available:
            return 0
        sent = 0
        for message in convert.draft_request_to_wire(request):  # large features in chunks ahead of it
            data = message.SerializeToString()
            self.link.send(session_id, data)
            sent += len(data)
        return sent

    @property
    def available(self) -> bool:
        return self.lost is None and self.link is not None and self.link.broken is None

    def answered(self, seconds: float) -> None:
        self._answer_s.update(seconds)

    def stall_deadline(self) -> float:
        """How long a session may wait on the draft before it goes on without it."""
        return max(self.stall_s, STALL_FACTOR * self._answer_s.value)

    # --- on the event loop ------------------------------------------------------------------------

    def broke(self, reason: str) -> None:
        """The draft is lost (its link broke, or it hung): the sessions go on alone, and a
        replacement is asked for where the draft is an actor."""
        self.lost = reason
        log.warning("draft worker lost: %s", reason)
        self._on_lost(reason)
        if self.actor is not None and self._recovery is None:
            self._recovery = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        started, pause = time.monotonic(), RETRY_FIRST_S
        try:
            while True:
                try:
                    address = await serving_address(self.actor, "draft", self.recover_s, kill_when_hung=True)
                    link = self._link(address)
                    await link.open()
                except WorkerGone as exc:
                    log.warning("no replacement draft worker, ever: %s", exc)
                    return
                except (WorkerUnavailable, OSError) as exc:
                    log.warning("no replacement draft worker yet (next try in %.1f s): %s", pause, exc)
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, RETRY_MAX_S)
                    continue
                old, self.address = self.link, address
                log.warning("draft worker back at %s after %.1f s", address, time.monotonic() - started)
                self.relink(link)
                if old is not None:
                    await old.close()
                return
        finally:
            self._recovery = None

    def relink(self, link) -> None:
        """A replaced draft's link is open: the sessions re-attach (on_back)."""
        self.link, self.lost, self.replacements = link, None, self.replacements + 1
        self._on_back()

    async def watch(self) -> None:
        """Probe the connected draft's compute thread now and then: a stuck one (its process
        answers, its model never does) is killed for Ray to replace, and the sessions go on alone."""
        while True:
            await asyncio.sleep(PROBE_EVERY_S)
            if self.actor is None or not self.available:
                continue
            try:
                stats = await draft_stats(self.address, self._tls)
            except Exception:  # noqa: BLE001 - a broken link reports itself; the probe only looks for a hang
                continue
            if stats.unavailable:
                self.kill_hung(stats.unavailable)

    def kill_hung(self, reason: str) -> None:
        import ray

        log.warning("draft worker hung (%s): killing it so that Ray replaces it", reason)
        ray.kill(self.actor, no_restart=False)
        if self.link is not None:
            self.link.broken = self.link.broken or reason
        self.broke(f"the draft worker hung: {reason}")
