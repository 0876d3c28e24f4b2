"""Backpressure on one replica: at most max_in_flight sessions generate at once, at most
max_waiting requests wait for a slot; a request past both is refused at once with a 429."""

from __future__ import annotations

import asyncio

from svip_serve.protocol import ApiError

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_in_flight: int, max_waiting: int, on_change=lambda running, waiting: None):
        self.max_in_flight, self.max_waiting = max_in_flight, max_waiting
        self.running = self.waiting = 0
        self._slots = asyncio.Semaphore(max_in_flight)
        self._on_change = on_change

    def reserve(self) -> Slot:
        """A place in line, or ApiError 429 when the replica is full."""
        if self.running + self.waiting >= self.max_in_flight + self.max_waiting:
            raise ApiError(
                429,
                f"server busy: {self.running} requests generating and {self.waiting} waiting on this replica "
                f"(limits {self.max_in_flight} and {self.max_waiting}); retry later",
                type_="rate_limit_error", code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.waiting += 1
        self._changed()
        return Slot(self)

    def _changed(self) -> None:
        self._on_change(self.running, self.waiting)


class Slot:
    """`async with slot:` waits for a session slot and holds it; release() is idempotent, so a
    slot given up before it was entered (client gone) frees its place in line too."""

    def __init__(self, admission: Admission):
        self._adm = admission
        self._state = "waiting"

    async def __aenter__(self) -> Slot:
        try:
            await self._adm._slots.acquire()
        except BaseException:  # cancelled while waiting (the client left): give the place back
            self.release()
            raise
        self._state = "running"
        self._adm.waiting -= 1
        self._adm.running += 1
        self._adm._changed()
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        if self._state == "waiting":
            self._adm.waiting -= 1
        elif self._state == "running":
            self._adm.running -= 1
            self._adm._slots.release()
        else:
            return
        self._state = "released"
        self._adm._changed()
