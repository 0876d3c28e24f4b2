"""What structured output may cost the replica's parse thread (review H-2). Bytes bound a grammar's
text, not the time it takes to compile, so:

- one grammar: at most ``budget_s`` of CPU to compile (svip_common/grammar.py times it on the parse
  thread's clock, once per text: the cache answers the same text again); past it, a 400 that says
  so. (A 62 KB schema of 1,300 `"format": "uri"` fields took 0.6 s here; a typical schema a few ms.)
- one API key (or the open API, as one): at most KEY_BUDGETS times ``budget_s`` of the parse
  thread's CPU over any minute (its body, its grammars); past it, its next request is a 429 until
  the minute's spend drains, so one key sending ever new costly schemas cannot hold the thread that
  every tenant's bodies wait on.

Runs on the replica's one parse thread."""

from __future__ import annotations

import threading
import time

from svip_serve.protocol import ApiError, bad

KEY_BUDGETS = 16  # a key's parse CPU a minute, in grammar budgets
WINDOW_S = 60.0


class CompileBudget:
    def __init__(self, budget_s: float, clock=time.monotonic):
        self.budget_s, self.per_key_s = budget_s, KEY_BUDGETS * budget_s
        self._clock = clock
        self._spent: dict[str | None, tuple[float, float]] = {}  # key -> (CPU seconds, when), draining
        self._lock = threading.Lock()

    def parse(self, key: str | None, parse, *args):
        """parse(*args) for a request of this key: refused (429) while the key's minute is spent, its
        CPU time charged to the key, and each grammar it compiled held to the budget (400)."""
        if self.spent(key) > self.per_key_s:
            raise ApiError(429, f"this API key spent {self.spent(key):.1f} s of the server's parse time in the last "
                           f"minute (limit {self.per_key_s:.1f} s: grammars and bodies); retry later",
                           type_="rate_limit_error", code="parse_budget", headers={"Retry-After": "10"})
        started = time.thread_time()
        try:
            req = parse(*args)
        finally:
            self._charge(key, time.thread_time() - started)
        for grammar, field in grammars_of(req):
            seconds = grammar.compile_seconds()
            if seconds > self.budget_s:
                raise bad(f"the {grammar.kind} took {seconds * 1000:.0f} ms to compile; this deployment allows "
                          f"{self.budget_s * 1000:.0f} ms: simplify it (fewer properties, formats or patterns)", field)
        return req

    def spent(self, key: str | None) -> float:
        """The key's parse CPU seconds, drained at per_key_s a minute."""
        with self._lock:
            seconds, at = self._spent.get(key, (0.0, self._clock()))
            return max(0.0, seconds - (self._clock() - at) * self.per_key_s / WINDOW_S)

    def _charge(self, key: str | None, seconds: float) -> None:
        left = self.spent(key)
        with self._lock:
            if left + seconds > 0:
                self._spent[key] = (left + seconds, self._clock())
            else:
                self._spent.pop(key, None)


def grammars_of(req) -> list:
    """The grammars a parsed request compiled: its response_format's and its tools' (field named)."""
    out = []
    if req.sampling.grammar is not None:
        out.append((req.sampling.grammar, "response_format"))
    if req.tools is not None and req.tools.grammar is not None and req.tools.grammar is not req.sampling.grammar:
        out.append((req.tools.grammar, "tools"))
    return out
