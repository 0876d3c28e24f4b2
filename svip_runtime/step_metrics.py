"""What each worker's batched steps look like, as Prometheus series through Ray's metrics agent
(only inside a Ray worker; elsewhere, as in tests that host a service in-process, nothing is
recorded): sessions per step, tokens per step, and the KV pool's pages in use."""

from __future__ import annotations

BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
TOKEN_BUCKETS = [1, 4, 16, 64, 128, 256, 512, 1024, 2048, 8192]


class StepMetrics:
    def __init__(self, role: str):
        self.tags = {"role": role}
        self._on = False
        try:
            import ray

            if not ray.is_initialized():
                return
            from ray.util import metrics as m
        except ImportError:
            return
        keys = ("role",)
        self.batch = m.Histogram(
            "svip_step_batch_size", "Sessions served by one worker forward.", boundaries=BATCH_BUCKETS, tag_keys=keys
        )
        self.tokens = m.Histogram(
            "svip_step_tokens", "Tokens in one worker forward.", boundaries=TOKEN_BUCKETS, tag_keys=keys
        )
        self.kv_used = m.Gauge("svip_kv_cache_pages_used", "KV pool pages held by sessions.", tag_keys=keys)
        self.kv_free = m.Gauge("svip_kv_cache_pages_free", "KV pool pages free.", tag_keys=keys)
        self._pages: tuple[int, int] | None = None  # the gauges' values as last set
        self._on = True

    def record(self, sessions: int, tokens: int, pool) -> None:
        if not self._on:
            return
        self.batch.observe(sessions, self.tags)
        self.tokens.observe(tokens, self.tags)
        pages = (pool.used_pages, pool.free_pages)
        if pages != self._pages:  # a gauge holds its last value: set it when it changes (a page boundary)
            self.kv_used.set(pages[0], self.tags)
            self.kv_free.set(pages[1], self.tags)
            self._pages = pages
