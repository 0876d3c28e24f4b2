"""The workers' stats for /v1/svip/workers, probed at most once per ``fresh_s`` however many ask:
calls at once share one probe (a caller that goes away leaves it running for the others), and a
probe's answer serves every call within ``fresh_s`` of it. A flood of calls costs the workers a
probe each ``fresh_s`` (review L-1: each call used to wait on the target's compute thread and open
a channel to the draft)."""

from __future__ import annotations

import asyncio
import time

WORKER_STATS_FRESH_S = 0.25


class FreshStats:
    def __init__(self, fresh_s: float = WORKER_STATS_FRESH_S, clock=time.monotonic):
        self.fresh_s, self._clock = fresh_s, clock
        self._value: dict | None = None
        self._at = float("-inf")
        self._pending: asyncio.Future | None = None
        self.probes = 0

    async def get(self, engine) -> dict:
        """engine.worker_stats(), or an answer younger than fresh_s."""
        if self._value is not None and self._clock() - self._at < self.fresh_s:
            return self._value
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._probe(engine))
        return await asyncio.shield(self._pending)

    async def _probe(self, engine) -> dict:
        try:
            self.probes += 1
            value = await engine.worker_stats()
            self._value, self._at = value, self._clock()
            return value
        finally:
            self._pending = None
