"""The target worker's way to its draft worker, one that outlives the draft: the current
``DraftLink`` (coordinator/client.py), the draft's Ray actor to get a replacement from, and what
the stall deadlines follow.

When the link breaks (the draft's process died) the sessions are told at once (``on_lost``, they
go on without it) and, where the draft is a Ray actor with restarts left, the port asks it for its
address again: Ray restarts a dead actor, and its ``serve()`` loads the weights and serves again.
The new link opens and the sessions are told (``on_back``, they re-attach). A draft that never
comes back within the recovery deadline leaves the sessions to the target alone, never an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from coordinator.client import DraftLink
from coordinator.cluster import WorkerGone, serving_address
from svip_common.errors import WorkerUnavailable
from svip_common.tls import TlsFiles
from svip_proto import svip_pb2 as pb

log = logging.getLogger(__name__)

STALL_FACTOR = 10.0  # a draft that takes this many times its usual answer time is stalled
DEFAULT_STALL_S = 3.0  # ...and never less than this (a first block carries the prompt's prefill)
DEFAULT_RECOVER_S = 120.0  # how long the port keeps asking for a replaced draft
_EWMA = 0.1


class DraftPort:
    def __init__(self, address: str | None, actor, on_event: Callable[[pb.DraftEvent, float, int], None],
                 on_lost: Callable[[str], None], on_back: Callable[[], None], tls: TlsFiles | None = None,
                 stall_s: float = DEFAULT_STALL_S, recover_s: float = DEFAULT_RECOVER_S):
        """address: the draft worker's (None: ask the actor); actor: its Ray actor handle (None:
        no replacement can be had). on_lost(reason) / on_back() are called on the event loop."""
        self.address, self.actor, self._tls = address, actor, tls
        self._on_event, self._on_lost, self._on_back = on_event, on_lost, on_back
        self.stall_s, self.recover_s = stall_s, recover_s
        self.link: DraftLink | None = None
        self.lost: str | None = None  # why no draft is connected now
        self.replacements = 0  # links opened to a replaced draft worker
        self._answer_s: float | None = None
        self._recovery: asyncio.Task | None = None

    async def open(self) -> None:
        """Connect to the draft; one that cannot be reached now (being replaced) is recovered in
        the background while the target serves alone."""
        try:
            if self.address is None:
                self.address = await serving_address(self.actor, "draft", self.recover_s)
            link = self._link(self.address)
            await link.open()
        except WorkerUnavailable as exc:
            if self.actor is None:
                raise
            self._broken(str(exc))
            return
        self.link = link

    def _link(self, address: str) -> DraftLink:
        return DraftLink(address, self._on_event, self._broken, self._tls)

    async def close(self) -> None:
        if self._recovery is not None:
            self._recovery.cancel()
        if self.link is not None:
            await self.link.close()

    # --- from the compute thread ------------------------------------------------------------------

    def send(self, session_id: str, request: pb.DraftRequest) -> None:
        if self.available:  # else the sessions are detached: nothing to send
            self.link.send(session_id, request)

    @property
    def available(self) -> bool:
        return self.lost is None and self.link is not None and self.link.broken is None

    def answered(self, seconds: float) -> None:
        self._answer_s = seconds if self._answer_s is None else (1 - _EWMA) * self._answer_s + _EWMA * seconds

    def stall_deadline(self) -> float:
        """How long a session may wait on the draft before it goes on without it."""
        return max(self.stall_s, STALL_FACTOR * (self._answer_s or 0.0))

    # --- on the event loop ------------------------------------------------------------------------

    def _broken(self, reason: str) -> None:
        self.lost = reason
        log.warning("draft worker lost: %s", reason)
        self._on_lost(reason)
        if self.actor is not None and self._recovery is None:
            self._recovery = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        started, deadline = time.monotonic(), time.monotonic() + self.recover_s
        try:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    address = await serving_address(self.actor, "draft", left)
                    link = self._link(address)
                    await link.open()
                except WorkerGone as exc:
                    log.warning("no replacement draft worker: %s", exc)
                    return
                except WorkerUnavailable as exc:
                    log.warning("no replacement draft worker yet: %s", exc)
                    await asyncio.sleep(0.5)
                    continue
                old, self.link, self.address = self.link, link, address
                self.lost, self.replacements = None, self.replacements + 1
                log.warning("draft worker back at %s after %.1f s", address, time.monotonic() - started)
                self._on_back()
                if old is not None:
                    await old.close()
                return
        finally:
            self._recovery = None
