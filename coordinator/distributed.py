"""The caller's end of the distributed pipeline: many concurrent sessions on one gRPC stream to
the target worker, which hosts each session beside its verifier (coordinator/host.py) and streams
back the settled tokens. The caller never sits on a round's path; it validates the request,
starts the session, and hands each settled piece to its callback as it arrives."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable

import grpc

from coordinator.client import BROKEN, WorkerConnection, draft_stats
from coordinator.pipeline import PIPELINES, WorkerError
from svip_common.contracts import AUTO, GenerationRequest, GenerationResult, Limits, PolicyConfig
from svip_common.errors import InvalidRequest, WorkerUnavailable
from svip_common.models import ModelInfo
from svip_common.tls import TlsFiles
from svip_proto import convert
from svip_proto import svip_pb2 as pb

# on_tokens(tokens) is called with each settled piece; returning True ends the output there (a stop string)
OnTokens = Callable[[list[int]], bool | None]


class DistributedEngine:
    def __init__(self, target: ModelInfo, limits: Limits, target_address: str, draft_address: str | None,
                 pipeline: str = "async", tls: TlsFiles | None = None):
        """draft_address: where the target worker's draft is (None: the target alone); the caller
        only reads its Stats."""
        if pipeline not in PIPELINES:
            raise InvalidRequest(f"unknown pipeline {pipeline!r}; choose sync or async")
        self.target, self.limits, self.pipeline = target, limits, pipeline
        self.draft_address, self._tls = draft_address, tls
        self.target_conn = WorkerConnection(target_address, tls)

    @classmethod
    def for_pair(cls, pair, pipeline: str = "async") -> DistributedEngine:
        return cls(pair.target_info, pair.limits, pair.target_address, pair.draft_address, pipeline, pair.tls)

    async def connect(self) -> None:
        await self.target_conn.open()

    def resolve(self, request: GenerationRequest) -> GenerationRequest:
        request = request.checked_for(self.draft_address is not None, self.limits)
        if request.policy.threshold == AUTO and request.policy.name == "svip":
            raise InvalidRequest("threshold 'auto' is available in-process only for now; pass a number")
        return request

    async def generate(self, request: GenerationRequest, on_tokens: OnTokens | None = None) -> GenerationResult:
        request = self.resolve(request)
        session_id = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        conn = self.target_conn
        conn.register(session_id, queue)
        generated: list[int] = []
        stopped, finished = False, None
        try:
            conn.send(pb.GenerateRequest(start=self._start(session_id, request)))
            while finished is None:
                event = await queue.get()
                if event is BROKEN:
                    raise WorkerUnavailable(conn.broken or "target worker went away")
                kind = event.WhichOneof("kind")
                if kind == "settled" and not stopped:
                    generated += event.settled.tokens
                    if on_tokens is not None and on_tokens(list(event.settled.tokens)):
                        stopped = True  # the rest would be cut anyway: end the session
                        conn.send(pb.GenerateRequest(cancel=pb.Cancel(session_id=session_id)))
                elif kind == "finished":
                    finished = event.finished
                elif kind == "error":
                    raise _error(event.error)
        finally:
            if finished is None and not conn.broken:  # the caller went away, or an error: free both workers
                try:
                    conn.send(pb.GenerateRequest(cancel=pb.Cancel(session_id=session_id)))
                except WorkerUnavailable:
                    pass
            conn.unregister(session_id)
        reason = "stop" if stopped else finished.finish_reason
        return GenerationResult(list(request.prompt_ids), generated, reason, convert.stats_from_proto(finished.stats))

    def _start(self, session_id: str, request: GenerationRequest) -> pb.StartSession:
        start = pb.StartSession(
            session_id=session_id, prompt_ids=request.prompt_ids, sampling=convert.sampling_to_proto(request.sampling),
            stop_token_ids=sorted(request.stop_ids(self.target.eos_token_ids)), max_new_tokens=request.max_new_tokens,
            pipeline=PIPELINES[self.pipeline],
        )
        policy = request.policy
        if isinstance(policy.threshold, str):  # 'auto' with a policy that does not read it
            policy = dataclasses.replace(policy, threshold=PolicyConfig.threshold)
        start.policy.CopyFrom(convert.policy_to_proto(policy))
        return start

    async def unavailable(self) -> str | None:
        """Why this engine cannot serve now (a worker or the link between them is down), or None."""
        if self.target_conn.broken:
            return self.target_conn.broken
        try:
            stats = await self.target_conn.stats()
        except grpc.aio.AioRpcError as exc:
            return f"target worker at {self.target_conn.address} does not answer ({exc.code().name})"
        return stats.unavailable or None

    async def worker_stats(self) -> dict:
        out = {"target": await self.target_conn.stats()}
        if self.draft_address is not None:
            out["draft"] = await draft_stats(self.draft_address, self._tls)
        return out

    async def close(self) -> None:
        await self.target_conn.close()


def _error(err: pb.Error) -> Exception:
    code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    if err.code == code:
        return InvalidRequest(f"target worker: {err.message}")
    if err.code == grpc.StatusCode.UNAVAILABLE.value[0]:
        return WorkerUnavailable(err.message)
    return WorkerError(f"target worker: {err.message}")
