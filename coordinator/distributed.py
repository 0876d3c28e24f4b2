"""The caller's end of the distributed pipeline: many concurrent sessions on one gRPC stream to
the target worker, which hosts each session beside its verifier (coordinator/session/host.py) and streams
back the settled tokens. The caller never sits on a round's path; it validates the request,
starts the session, and hands each settled piece to its callback as it arrives.

The caller holds every token settled so far, so a session outlives its target worker: when the
stream breaks, one recovery (shared by every session on it) gets the replaced worker's address
(``recover``: Ray restarts the actor, coordinator/cluster.py), and each session starts again there
on its prompt plus what had settled, with what is left of its budget. Nothing is sent twice and
nothing is lost; since every draw is keyed by position, a seeded sampled session goes on as an
undisturbed one would. When recovery is impossible the session ends with WorkerUnavailable."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import grpc

from coordinator.client import BROKEN, WorkerConnection
from svip_common.contracts import (
    AUTO,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    Limits,
    PolicyConfig,
    TokenLogprob,
)
from svip_common.errors import InvalidRequest, Overloaded, WorkerError, WorkerUnavailable
from svip_common.models import ModelInfo
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_runtime.grpc_server import draft_stats
from svip_runtime.tls import TlsFiles

# on_tokens(tokens, logprobs) is called with each settled piece (logprobs: TokenLogprob per token when the
# request asked for them, else empty); returning True ends the output there (a stop string)
OnTokens = Callable[[list[int], list[TokenLogprob]], bool | None]
OnPrompt = Callable[[list[TokenLogprob]], None]  # the prompt's logprobs, before any token (echo's stream)
Recover = Callable[[], Awaitable[str]]  # the target worker's address once it serves again (WorkerUnavailable: never)
log = logging.getLogger(__name__)
DRAFT_STATS_WAIT_S = 5.0  # how long Stats waits for a replaced draft's address
NO_PROGRESS_S = 300.0  # a session that hears nothing for this long ends with WorkerUnavailable (never a hang)
MAX_SESSION_RESTARTS = 2  # a request goes on through this many target restarts; the next loss fails it


class _StreamLost(Exception):
    """The stream to the target worker broke under a session (the worker died, or hangs)."""


@dataclasses.dataclass
class Recoveries:
    """Target recoveries of this engine (metrics read it; per-session costs are in the stats)."""

    restarts: int = 0  # target workers replaced


class DistributedEngine:
    def __init__(self, target: ModelInfo, limits: Limits, target_address: str, draft_address: str | None,
                 pipeline: str = "async", tls: TlsFiles | None = None, recover: Recover | None = None,
                 draft_address_now: Callable[..., Awaitable[str]] | None = None):
        """draft_address: where the target worker's draft is (None: the target alone); the caller
        only reads its Stats. recover: how to get a replaced target worker (None: a lost target
        ends its sessions with WorkerUnavailable); draft_address_now: the draft's address now
        (it changes when the draft is replaced; asked when the one known does not answer)."""
        if pipeline not in convert.PIPELINES:
            raise InvalidRequest(f"unknown pipeline {pipeline!r}; choose sync or async")
        self.target, self.limits, self.pipeline = target, limits, pipeline
        self.draft_address, self._tls = draft_address, tls
        self.target_conn = WorkerConnection(target_address, tls)
        self._recover, self._draft_address_now = recover, draft_address_now
        self._recovering: asyncio.Lock | None = None
        self._recovery_task: asyncio.Task | None = None  # a recovery a health check started
        self.recoveries = Recoveries()
        self.no_progress_s = NO_PROGRESS_S

    @classmethod
    def for_pair(cls, pair, pipeline: str = "async") -> DistributedEngine:
        return cls(pair.target_info, pair.limits, pair.target_address, pair.draft_address, pipeline, pair.tls,
                   recover=pair.recover_target, draft_address_now=pair.draft_serving_address)

    async def connect(self) -> None:
        await self.target_conn.open()

    def resolve(self, request: GenerationRequest) -> GenerationRequest:
        return resolved(request, self.draft_address is not None, self.limits)

    async def generate(self, request: GenerationRequest, on_tokens: OnTokens | None = None,
                       on_prompt: OnPrompt | None = None) -> GenerationResult:
        """on_tokens: each settled piece as it settles; on_prompt: the prompt's logprobs (a request
        with prompt_logprobs), once, before any token."""
        request = self.resolve(request)
        out = _Output(on_tokens, on_prompt)
        stop_ids = request.stop_ids(self.target.eos_token_ids)
        restarts, reprefilled, recover_s = 0, 0, 0.0
        while True:
            if out.generated and (out.generated[-1] in stop_ids or len(out.generated) >= request.max_new_tokens):
                finished = None  # the last piece settled the end; its Finished was lost with the worker
                break
            part = dataclasses.replace(request, prompt_ids=tuple(request.prompt_ids) + tuple(out.generated),
                                       max_new_tokens=request.max_new_tokens - len(out.generated),
                                       prompt_logprobs=request.prompt_logprobs and out.prompt_logprobs is None)
            conn = self.target_conn
            try:
                finished = await self._session(conn, part, out)
                break
            except _StreamLost:
                if out.stopped:
                    finished = None
                    break
                if restarts >= MAX_SESSION_RESTARTS:  # a request that takes its target down each time ends here
                    raise WorkerUnavailable(f"the target worker was lost {restarts + 1} times during this request; "
                                            "giving it up") from None
                lost_at = time.monotonic()
                await self._recover_from(conn)
                restarts += 1
                reprefilled += len(request.prompt_ids) + len(out.generated)  # what the next session prefills
                recover_s += time.monotonic() - lost_at
        reason = "stop" if out.stopped else finished.finish_reason if finished is not None else (
            "stop" if out.generated[-1] in stop_ids else "length")
        stats = convert.stats_from_proto(finished.stats) if finished is not None else GenerationStats()
        if restarts:
            stats.target_restarts, stats.reprefilled_tokens, stats.recover_s = restarts, reprefilled, recover_s
        logprobs = out.logprobs if request.logprobs is not None else None
        return GenerationResult(list(request.prompt_ids), out.generated, reason, stats, logprobs=logprobs,
                                prompt_logprobs=out.prompt_logprobs)

    async def _session(self, conn: WorkerConnection, request: GenerationRequest, out: _Output) -> pb.Finished:
        """One session on one target worker, to its Finished (or _StreamLost)."""
        session_id = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        conn.register(session_id, queue)
        finished = None
        try:
            try:
                conn.send(pb.GenerateRequest(start=start_message(session_id, request, self.target, self.pipeline)))
            except WorkerUnavailable:
                raise _StreamLost() from None
            while finished is None:
                try:
                    event = await asyncio.wait_for(queue.get(), self.no_progress_s)
                except asyncio.TimeoutError:
                    raise WorkerUnavailable(f"the target worker at {conn.address} sent nothing for this session in "
                                            f"{self.no_progress_s:.0f} s") from None
                if event is BROKEN:
                    raise _StreamLost()
                kind = event.WhichOneof("kind")
                if kind == "settled" and not out.stopped:
                    logprobs, prompt_logprobs = convert.settled_logprobs(event.settled, request.prompt_ids)
                    if prompt_logprobs is not None and out.prompt_logprobs is None:
                        out.scored(prompt_logprobs)
                    if out.take(list(event.settled.tokens), logprobs):  # the rest would be cut anyway: end it
                        conn.send(pb.GenerateRequest(cancel=pb.Cancel(session_id=session_id)))
                elif kind == "finished":
                    finished = event.finished
                elif kind == "error":
                    raise error_from_proto(event.error)
        finally:
            if finished is None and not conn.broken:  # the caller went away, or an error: free both workers
                try:
                    conn.send(pb.GenerateRequest(cancel=pb.Cancel(session_id=session_id)))
                except WorkerUnavailable:
                    pass
            conn.unregister(session_id)
        return finished

    async def _recover_from(self, lost: WorkerConnection) -> None:
        """Replace a broken target connection, once for every session that saw it break."""
        if self._recovering is None:
            self._recovering = asyncio.Lock()
        async with self._recovering:
            if self.target_conn is not lost:
                if self.target_conn.broken is None:
                    return  # another session already recovered
                lost = self.target_conn
            if self._recover is None:
                raise WorkerUnavailable(lost.broken or "target worker went away")
            log.warning("target worker lost (%s); recovering", lost.broken)
            conn = WorkerConnection(await self._recover(), self._tls)
            await conn.open()
            self.target_conn = conn
            self.recoveries.restarts += 1
            await lost.close()

    async def unavailable(self) -> str | None:
        """Why this engine cannot serve now, or None. A broken target connection starts its
        recovery in the background (a health check never runs it inline: a slow replacement must
        not make the check time out and the replica be killed mid-recovery); while it runs, the
        engine counts as available (`recovering` says so). A recovery that failed is the answer."""
        if self.target_conn.broken:
            task = self._recovery_task
            if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
                return str(task.exception())
            if task is None or task.done():
                self._recovery_task = asyncio.get_running_loop().create_task(self._recover_from(self.target_conn))
            return None
        try:
            stats = await self.target_conn.stats()
        except grpc.aio.AioRpcError as exc:
            return f"target worker at {self.target_conn.address} does not answer ({exc.code().name})"
        return stats.unavailable or None

    @property
    def recovering(self) -> bool:
        """A target recovery started by a health check is under way."""
        return self._recovery_task is not None and not self._recovery_task.done()

    async def worker_stats(self) -> dict:
        """role -> WorkerStats; the draft's is left out while it is down (the target serves alone)."""
        out = {"target": await self.target_conn.stats()}
        if self.draft_address is not None:
            try:
                out["draft"] = await draft_stats(self.draft_address, self._tls)
            except (WorkerUnavailable, grpc.aio.AioRpcError):
                if self._draft_address_now is not None:
                    try:  # replaced: it serves on a new port
                        self.draft_address = await self._draft_address_now(DRAFT_STATS_WAIT_S)
                        out["draft"] = await draft_stats(self.draft_address, self._tls)
                    except (WorkerUnavailable, grpc.aio.AioRpcError):
                        pass
        return out

    async def close(self) -> None:
        if self._recovery_task is not None:
            self._recovery_task.cancel()
        await self.target_conn.close()


class _Output:
    """What a request has settled so far, across the sessions it took, and its stop-string cut."""

    def __init__(self, on_tokens: OnTokens | None, on_prompt: OnPrompt | None = None):
        self.on_tokens, self.on_prompt = on_tokens, on_prompt
        self.generated: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # per generated token, when the request asked for them
        self.prompt_logprobs: list[TokenLogprob] | None = None  # the first session's, when asked for
        self.stopped = False

    def scored(self, prompt_logprobs: list[TokenLogprob]) -> None:
        self.prompt_logprobs = prompt_logprobs
        if self.on_prompt is not None:
            self.on_prompt(prompt_logprobs)

    def take(self, tokens: list[int], logprobs: list[TokenLogprob]) -> bool:
        """Settled tokens and their logprobs (none unless asked for); True once the caller's
        callback ended the output (a stop string)."""
        self.generated += tokens
        self.logprobs += logprobs
        if self.on_tokens is not None and self.on_tokens(tokens, logprobs):
            self.stopped = True
        return self.stopped


def resolved(request: GenerationRequest, speculates: bool, limits: Limits) -> GenerationRequest:
    """A request checked for a distributed pair (with a draft or not) within its limits."""
    request = request.checked_for(speculates, limits)
    if request.policy.threshold == AUTO and request.policy.name == "svip":
        raise InvalidRequest("threshold 'auto' is available in-process only for now; pass a number")
    return request


def start_message(session_id: str, request: GenerationRequest, target: ModelInfo, pipeline: str) -> pb.StartSession:
    """The StartSession the caller sends the target worker for a resolved request."""
    start = pb.StartSession(
        session_id=session_id, prompt_ids=request.prompt_ids, sampling=convert.sampling_to_proto(request.sampling),
        stop_token_ids=sorted(request.stop_ids(target.eos_token_ids)), max_new_tokens=request.max_new_tokens,
        pipeline=convert.PIPELINES[pipeline], cache_scope=request.cache_scope,
    )
    if request.logprobs is not None:
        start.logprobs = request.logprobs
    start.prompt_logprobs = request.prompt_logprobs
    policy = request.policy
    if isinstance(policy.threshold, str):  # 'auto' with a policy that does not read it
        policy = dataclasses.replace(policy, threshold=PolicyConfig.threshold)
    start.policy.CopyFrom(convert.policy_to_proto(policy))
    return start


def error_from_proto(err: pb.Error) -> Exception:
    """A worker's error event as the exception the caller raises (its gRPC code kept as our kind)."""
    code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    if err.code == code:
        return InvalidRequest(f"target worker: {err.message}")
    if err.code == grpc.StatusCode.UNAVAILABLE.value[0]:
        return WorkerUnavailable(err.message)
    if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
        return Overloaded(f"target worker: {err.message}")
    return WorkerError(f"target worker: {err.message}")
