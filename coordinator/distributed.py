"""The coordinator over remote workers: many concurrent sessions multiplexed on one gRPC stream
per worker, each run by a SessionPipeline (sync or async)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from coordinator.client import WorkerConnection
from coordinator.pipeline import PIPELINES, SessionPipeline
from svip_common.contracts import AUTO, GenerationRequest, GenerationResult, Limits
from svip_common.errors import InvalidRequest
from svip_common.models import ModelInfo
from svip_proto import svip_pb2_grpc as pb_grpc


class DistributedEngine:
    def __init__(self, target: ModelInfo, limits: Limits, target_address: str, draft_address: str | None,
                 pipeline: str = "async"):
        if pipeline not in PIPELINES:
            raise InvalidRequest(f"unknown pipeline {pipeline!r}; choose sync or async")
        self.target, self.limits, self.pipeline = target, limits, pipeline
        self.target_conn = WorkerConnection("target", target_address, pb_grpc.TargetWorkerStub)
        self.draft_conn = WorkerConnection("draft", draft_address, pb_grpc.DraftWorkerStub) if draft_address else None

    async def connect(self) -> None:
        await self.target_conn.open()
        if self.draft_conn is not None:
            await self.draft_conn.open()

    def resolve(self, request: GenerationRequest) -> GenerationRequest:
        request = request.checked_for(self.draft_conn is not None, self.limits)
        if request.policy.threshold == AUTO and request.policy.name == "svip":
            raise InvalidRequest("threshold 'auto' is available in-process only for now; pass a number")
        return request

    async def generate(self, request: GenerationRequest, on_tokens: Callable[[list[int]], bool | None] | None = None) -> GenerationResult:
        request = self.resolve(request)
        stop_ids = request.stop_ids(self.target.eos_token_ids)
        draft = None if request.policy.name == "none" else self.draft_conn
        session = SessionPipeline(uuid.uuid4().hex, request, stop_ids, self.target_conn, draft, self.pipeline, on_tokens)
        return await session.run()

    async def worker_stats(self) -> dict:
        out = {"target": await self.target_conn.stats()}
        if self.draft_conn is not None:
            out["draft"] = await self.draft_conn.stats()
        return out

    async def close(self) -> None:
        for conn in (self.target_conn, self.draft_conn):
            if conn is not None:
                await conn.close()
