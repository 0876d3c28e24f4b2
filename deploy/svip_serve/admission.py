"""Backpressure on one replica, by sessions, by KV tokens and by API key: a request generates once a
session slot is free (at most max_in_flight) and its prompt plus max_tokens fit the KV room left in
the pipeline's pools. Until then it waits in line; whoever fits goes first, so small requests pass a
large one at the head that does not fit yet (the large one keeps its place and is admitted as soon
as the room is there). A request that would wait when max_waiting already do, that has waited
max_wait_s, or whose key already has max_per_key requests running or waiting is refused with a 429.
A request larger than the whole pool never gets here (the engine refuses it with a 400 naming the
KV cache)."""

from __future__ import annotations

import asyncio
from collections import Counter

from svip_serve.protocol import ApiError

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_in_flight: int, max_waiting: int, kv_tokens: int | None = None,
                 on_change=lambda running, waiting: None, max_wait_s: float | None = None, max_per_key: int = 0):
        self.max_in_flight, self.max_waiting = max_in_flight, max_waiting
        self.kv_tokens = kv_tokens  # None: not counted
        self.max_wait_s = max_wait_s  # None: a waiter waits as long as it takes
        self.max_per_key = max_per_key  # 0: no limit per key
        self.kv_used = 0
        self.running = self.waiting = 0
        self.per_key: Counter[str] = Counter()  # requests running or waiting, by API key id
        self._line: list[Slot] = []
        self._on_change = on_change

    def reserve(self, kv_tokens: int = 0, key: str | None = None) -> Slot:
        """A place for a request that will hold kv_tokens: running at once when a slot and the
        room are free, else in line; ApiError 429 when the line or the key's share is full."""
        if key is not None and self.max_per_key and self.per_key[key] >= self.max_per_key:
            raise self._busy(f"API key {key!r} already has {self.per_key[key]} requests on this replica "
                             f"(limit {self.max_per_key})")
        slot = Slot(self, kv_tokens, key)
        if self._fits(kv_tokens):
            self._start(slot)
        elif self.waiting >= self.max_waiting:
            kv = f", KV tokens {self.kv_used} of {self.kv_tokens} held" if self.kv_tokens is not None else ""
            raise self._busy(f"{self.running} requests generating and {self.waiting} waiting on this replica "
                             f"(limits {self.max_in_flight} and {self.max_waiting}{kv})")
        else:
            self.waiting += 1
            self._line.append(slot)
        if key is not None:
            self.per_key[key] += 1
        self._changed()
        return slot

    def _busy(self, why: str) -> ApiError:
        return ApiError(429, f"server busy: {why}; retry later", type_="rate_limit_error", code="server_busy",
                        headers={"Retry-After": str(RETRY_AFTER_S)})

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
        """Admit, in order of arrival, every waiter that fits now."""
        for slot in list(self._line):
            if self.running >= self.max_in_flight:
                break
            if self._fits(slot.kv_tokens):
                self._line.remove(slot)
                self.waiting -= 1
                self._start(slot)
        self._changed()

    def _changed(self) -> None:
        self._on_change(self.running, self.waiting)


class Slot:
    """`await slot.admitted()` (or `async with slot:`) waits until the request runs (a session slot
    and its KV room) and holds them; release() is idempotent, so a slot given up before it was
    entered (client gone) frees its place too."""

    def __init__(self, admission: Admission, kv_tokens: int, key: str | None = None):
        self._adm = admission
        self.kv_tokens, self.key = kv_tokens, key
        self._state = "waiting"
        self._admitted: asyncio.Future = asyncio.get_running_loop().create_future()

    async def admitted(self) -> Slot:
        """Waits for the place; gives it back when cancelled (the client left) and answers 429
        once the replica's waiting deadline has passed."""
        try:
            await asyncio.wait_for(asyncio.shield(self._admitted), self._adm.max_wait_s)
        except asyncio.TimeoutError:
            self.release()
            raise self._adm._busy(f"waited {self._adm.max_wait_s:g} s for a place on this replica") from None
        except BaseException:
            self.release()
            raise
        return self

    async def __aenter__(self) -> Slot:
        return await self.admitted()

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
        if self.key is not None:
            adm.per_key[self.key] -= 1
            if not adm.per_key[self.key]:
                del adm.per_key[self.key]
        adm._dispatch()
