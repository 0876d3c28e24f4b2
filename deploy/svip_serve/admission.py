"""Backpressure on one replica, by sessions and by KV tokens: a request generates once a session
slot is free (at most max_in_flight) and its prompt plus max_tokens fit the KV room left in the
pipeline's pools; until then it waits in line (first come, first served), and a request that
would wait when max_waiting already do is refused at once with a 429. A request larger than the whole pool never gets here
(the engine refuses it with a 400 naming the KV cache)."""

from __future__ import annotations

import asyncio
from collections import deque

from svip_serve.protocol import ApiError

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_in_flight: int, max_waiting: int, kv_tokens: int | None = None,
                 on_change=lambda running, waiting: None):
        self.max_in_flight, self.max_waiting = max_in_flight, max_waiting
        self.kv_tokens = kv_tokens  # None: not counted
        self.kv_used = 0
        self.running = self.waiting = 0
        self._line: deque[Slot] = deque()
        self._on_change = on_change

    def reserve(self, kv_tokens: int = 0) -> Slot:
        """A place for a request that will hold kv_tokens: running at once when a slot and the
        room are free and nobody is in line, else in line; ApiError 429 when the line is full."""
        slot = Slot(self, kv_tokens)
        if not self._line and self._fits(kv_tokens):
            self._start(slot)
        elif self.waiting >= self.max_waiting:
            kv = f", KV tokens {self.kv_used} of {self.kv_tokens} held" if self.kv_tokens is not None else ""
            raise ApiError(
                429,
                f"server busy: {self.running} requests generating and {self.waiting} waiting on this replica "
                f"(limits {self.max_in_flight} and {self.max_waiting}{kv}); retry later",
                type_="rate_limit_error", code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        else:
            self.waiting += 1
            self._line.append(slot)
        self._changed()
        return slot

    def _fits(self, kv_tokens: int) -> bool:
        room = self.kv_tokens is None or self.kv_used + kv_tokens <= self.kv_tokens
        return self.running < self.max_in_flight and room

    def _start(self, slot: Slot) -> None:
        self.running += 1
        self.kv_used += slot.kv_tokens
        slot._state = "running"
        if not slot._admitted.done():
            slot._admitted.set_result(None)

    def _dispatch(self) -> None:
        """Admit from the head of the line while the head fits."""
        while self._line and self._fits(self._line[0].kv_tokens):
            self.waiting -= 1
            self._start(self._line.popleft())
        self._changed()

    def _changed(self) -> None:
        self._on_change(self.running, self.waiting)


class Slot:
    """`async with slot:` waits until the request runs (a session slot and its KV room) and holds
    them; release() is idempotent, so a slot given up before it was entered (client gone) frees
    its place too."""

    def __init__(self, admission: Admission, kv_tokens: int):
        self._adm = admission
        self.kv_tokens = kv_tokens
        self._state = "waiting"
        self._admitted: asyncio.Future = asyncio.get_running_loop().create_future()

    async def __aenter__(self) -> Slot:
        try:
            await self._admitted
        except BaseException:  # cancelled while waiting (the client left): give the place back
            self.release()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        adm = self._adm
        if self._state == "waiting":
            if self in adm._line:
                adm._line.remove(self)
            adm.waiting -= 1
        elif self._state == "running":
            adm.running -= 1
            adm.kv_used -= self.kv_tokens
        else:
            return
        self._state = "released"
        adm._dispatch()
