"""Backpressure on one replica, by sessions, by KV tokens and by API key. A request generates
once a session slot is free (at most max_in_flight) and its prompt fits the KV room left in the
pipeline's pools: a session then takes pages as it grows, and the target worker makes room by
preemption when they run short (coordinator/session/host.py). Until then it waits in line;
whoever fits goes first, so small requests pass a large one at the head that does not fit yet
(the large one keeps its place and is admitted as soon as the room is there). A request that
would wait when max_waiting already do, or that has waited max_wait_s, is refused with a 429.
Per API key: a request is counted from the moment its key is checked (``enter``, before its body
is read, parsed or tokenized), so one key cannot fill the replica's parse and tokenizer queue
either; past max_per_key requests, or past max_kv_per_key KV tokens (prompt + max_tokens) held
or waited for, the key's next request is a 429 (a 400 where it alone needs more than the key may
hold). A request larger than the whole pool never gets here (the engine refuses it with a 400
naming the KV cache)."""

from __future__ import annotations

import asyncio
from collections import Counter

from svip_serve.protocol import ApiError

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_in_flight: int, max_waiting: int, kv_tokens: int | None = None,
                 on_change=lambda running, waiting: None, max_wait_s: float | None = None, max_per_key: int = 0,
                 max_kv_per_key: int = 0):
        self.max_in_flight, self.max_waiting = max_in_flight, max_waiting
        self.kv_tokens = kv_tokens  # None: not counted
        self.max_wait_s = max_wait_s  # None: a waiter waits as long as it takes
        self.max_per_key = max_per_key  # 0: no limit per key
        self.max_kv_per_key = max_kv_per_key  # 0: no limit per key
        self.kv_used = 0
        self.running = self.waiting = 0
        self.per_key: Counter[str] = Counter()  # requests from their key's check to their end, by API key id
        self.kv_per_key: Counter[str] = Counter()  # KV tokens held or waited for, by API key id
        self._line: list[Slot] = []
        self._on_change = on_change

    def enter(self, key: str | None) -> KeyTicket:
        """A request of this key arrived (its key checked, nothing else done yet): counted until
        the ticket is released; ApiError 429 when the key already has max_per_key requests."""
        if key is not None and self.max_per_key and self.per_key[key] >= self.max_per_key:
            raise self._busy(f"API key {key!r} already has {self.per_key[key]} requests on this replica "
                             f"(limit {self.max_per_key})")
        if key is not None:
            self.per_key[key] += 1
        return KeyTicket(self, key)

    def reserve(self, kv_tokens: int = 0, ticket: KeyTicket | None = None, worst_kv_tokens: int | None = None
                ) -> Slot:
        """A place for a request that starts with kv_tokens (its prompt: the target takes pages
        as a session grows, and makes room by preemption): running at once when a slot and the
        room are free, else in line; ApiError 429 when the line or the key's KV share is full.
        The key's share counts worst_kv_tokens (prompt + max_tokens; default kv_tokens). The slot
        takes the ticket over: releasing the slot releases it."""
        key = ticket.key if ticket is not None else None
        worst = kv_tokens if worst_kv_tokens is None else worst_kv_tokens
        if key is not None and self.max_kv_per_key:
            if worst > self.max_kv_per_key:
                raise ApiError(400, f"this request needs {worst} KV tokens (its prompt and max_tokens); an API "
                               f"key may hold at most {self.max_kv_per_key} on this deployment: lower max_tokens",
                               param="max_tokens")
            if self.kv_per_key[key] + worst > self.max_kv_per_key:
                raise self._busy(f"API key {key!r} already holds {self.kv_per_key[key]} KV tokens on this replica "
                                 f"(limit {self.max_kv_per_key}; this request needs {worst})")
        slot = Slot(self, kv_tokens, ticket, worst)
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
            self.kv_per_key[key] += worst
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


class KeyTicket:
    """A request's place in its key's count, from its key's check to its end; release() is idempotent."""

    def __init__(self, admission: Admission, key: str | None):
        self._adm, self.key, self._held = admission, key, True

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        if self.key is not None:
            _take(self._adm.per_key, self.key, 1)


def _take(counter: Counter, key: str, amount: int) -> None:
    counter[key] -= amount
    if counter[key] <= 0:
        del counter[key]


class Slot:
    """`await slot.admitted()` (or `async with slot:`) waits until the request runs (a session slot
    and its KV room) and holds them; release() is idempotent, so a slot given up before it was
    entered (client gone) frees its place too, and its key's ticket."""

    def __init__(self, admission: Admission, kv_tokens: int, ticket: KeyTicket | None = None,
                 worst_kv_tokens: int | None = None):
        self._adm = admission
        self.kv_tokens, self.ticket = kv_tokens, ticket
        self.worst_kv_tokens = kv_tokens if worst_kv_tokens is None else worst_kv_tokens
        self.key = ticket.key if ticket is not None else None
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
            _take(adm.kv_per_key, self.key, self.worst_kv_tokens)
        if self.ticket is not None:
            self.ticket.release()
        adm._dispatch()
