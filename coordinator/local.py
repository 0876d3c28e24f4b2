"""The local distributed mode: Ray on this machine (loopback only), the two worker actors, and a
coordinator event loop, behind the same synchronous generate() as the in-process engine."""

from __future__ import annotations

import asyncio

from coordinator.cluster import WorkerPair, init_local_ray
from coordinator.distributed import DistributedEngine
from svip_common.contracts import GenerationRequest, GenerationResult


class LocalDistributed:
    def __init__(self, target_path: str, draft_path: str | None, pipeline: str = "async",
                 dtype: str = "float32", device: str = "cpu", target_gpus: int = 1):
        init_local_ray()
        gpus = device.startswith("cuda")
        self.pair = WorkerPair(target_path, draft_path, dtype=dtype, device=device,
                               target_gpus=target_gpus if gpus else 0, draft_gpus=1 if gpus else 0)
        self.target = self.pair.target_info
        self.draft_path = draft_path
        self.loop = asyncio.new_event_loop()
        self.engine = DistributedEngine(self.target, self.pair.limits, self.pair.target_address, self.pair.draft_address, pipeline)
        self.loop.run_until_complete(self.engine.connect())

    def resolve(self, request: GenerationRequest) -> GenerationRequest:
        return self.engine.resolve(request)

    def generate(self, request: GenerationRequest) -> GenerationResult:
        return self.loop.run_until_complete(self.engine.generate(request))

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
