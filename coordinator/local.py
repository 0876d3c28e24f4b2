"""The distributed mode behind the same synchronous generate() as the in-process engine: Ray on
this machine (loopback only) or an existing cluster (ray_address), the two worker actors (packed
on one node or spread over two; mutual TLS between them when given), and the caller's event
loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from coordinator.cluster import WorkerPair, init_local_ray
from coordinator.distributed import DistributedEngine
from svip_common.contracts import GenerationRequest, GenerationResult
from svip_common.knobs import default
from svip_common.kv_sizes import whole_pages
from svip_common.pair_config import PairConfig
from svip_proto import convert


class LocalDistributed:
    def __init__(self, config: PairConfig, pipeline: str = default("pipeline"), ray_address: str | None = None):
        """config: the pair and its workers (svip_common/pair_config.py); ray_address: an existing
        cluster's (None: a Ray of this machine's, on loopback). The pair checks the config."""
        if ray_address is None:
            init_local_ray(target_ranks=config.target_tp, draft_ranks=config.draft_tp)
        else:
            import ray

            ray.init(address=ray_address, log_to_driver=False)
        self.pair = WorkerPair(config)
        self.target = self.pair.target_info
        self.draft_path = config.draft
        self.loop = asyncio.new_event_loop()
        self.engine = DistributedEngine.for_pair(self.pair, pipeline)
        self.loop.run_until_complete(self.engine.connect())

    def resolve(self, request: GenerationRequest) -> GenerationRequest:
        return self.engine.resolve(request)

    def generate(self, request: GenerationRequest) -> GenerationResult:
        return self.loop.run_until_complete(self.engine.generate(request))

    def generate_many(self, requests: list[GenerationRequest], batch_size: int) -> list[GenerationResult]:
        """Up to batch_size sessions in flight at once (the workers batch their forwards), admitted
        by KV as the in-process batch is (run_admitted)."""
        requests = [self.engine.resolve(r) for r in requests]  # every bad request named before any runs
        return self.loop.run_until_complete(
            run_admitted(requests, batch_size, self.pair.limits.kv_tokens, self.engine.generate)
        )

    def device_use(self) -> dict | None:
        """Each worker's emulated device's use so far (role -> use), or None without device timing."""
        stats = self.loop.run_until_complete(self.engine.worker_stats())
        use = {role: convert.device_use_from_proto(s.emulated_device) for role, s in stats.items()
               if s.HasField("emulated_device")}
        return use or None

    def close(self) -> None:
        import ray

        self.loop.run_until_complete(self.engine.close())
        self.loop.close()
        self.pair.shutdown()
        ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


async def run_admitted(
    requests: list[GenerationRequest],
    batch_size: int,
    kv_tokens: int | None,
    generate: Callable[[GenerationRequest], Awaitable[GenerationResult]],
) -> list[GenerationResult]:
    """Each request generated once it is first in line, fewer than batch_size run and its prompt
    plus max tokens fit the KV pool (in whole pages) beside those running: a batch larger than
    the pool waits for room, never fills it (a full pool would fail every session of a step)."""
    room = asyncio.Condition()
    state = {"running": 0, "reserved": 0, "next": 0}

    def admissible(index: int, tokens: int) -> bool:
        fits = kv_tokens is None or state["reserved"] + tokens <= kv_tokens
        return state["next"] == index and state["running"] < batch_size and fits

    async def one(index: int, request: GenerationRequest) -> GenerationResult:
        tokens = whole_pages(len(request.prompt_ids) + request.max_new_tokens)
        async with room:
            await room.wait_for(lambda: admissible(index, tokens))
            state["running"] += 1
            state["reserved"] += tokens
            state["next"] += 1
            room.notify_all()
        try:
            return await generate(request)
        finally:
            async with room:
                state["running"] -= 1
                state["reserved"] -= tokens
                room.notify_all()

    return await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
