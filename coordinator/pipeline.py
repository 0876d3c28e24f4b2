"""One session of the distributed pipeline, as the coordinator sees it.

    draft  ──block(epoch, base)──►  coordinator  ──verify(block, appended)──►  target
    draft  ◄──feedback(verdict)──   coordinator  ◄────────verdict──────────    target

In async mode the draft writes block k+1 while the target verifies block k. On a full
acceptance the held block k+1 is sent on (its first token is checked against the target's stored
row for that position); on a rejection the epoch advances, the draft rolls back and every block
of the old epoch is discarded by its tag, never verified. Sync mode is the same exchange with no
block drafted ahead. Settled tokens stream to the caller as they settle; the caller's callback
may end the session (a stop string), which cancels it on both workers like any other finish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from coordinator.client import BROKEN, WorkerConnection, WorkerUnavailable
from coordinator.engine import clip_settled
from svip_common.contracts import NO_TOKEN, GenerationRequest, GenerationResult, GenerationStats
from svip_common.errors import InvalidRequest, SvipError
from svip_proto import convert
from svip_proto import svip_pb2 as pb

PIPELINES = {"sync": pb.PIPELINE_SYNC, "async": pb.PIPELINE_ASYNC}


class WorkerError(SvipError):
    """A worker failed while serving the session."""


class SessionPipeline:
    def __init__(
        self,
        session_id: str,
        request: GenerationRequest,
        stop_ids: frozenset[int],
        target: WorkerConnection,
        draft: WorkerConnection | None,
        pipeline: str,
        on_tokens: Callable[[list[int]], bool | None] | None = None,
    ):
        self.sid, self.request, self.stop_ids = session_id, request, stop_ids
        self.target, self.draft, self.pipeline = target, draft, pipeline
        self.on_tokens = on_tokens
        self.committed = list(request.prompt_ids)
        self.generated: list[int] = []
        self.target_known = len(self.committed)  # committed tokens the target has been sent
        self.epoch = 0
        self.in_verification: pb.Block | None = None
        self.held: pb.Block | None = None  # pre-drafted, waiting for the verdict before it
        self.finish_reason: str | None = None
        self.stats = GenerationStats()
        self.intervals: list[tuple[str, float, float]] = []

    async def run(self) -> GenerationResult:
        queue: asyncio.Queue = asyncio.Queue()
        conns = [c for c in (self.target, self.draft) if c is not None]
        for conn in conns:
            conn.register(self.sid, queue)
        self.started = time.time()
        try:
            self._start()
            while self.finish_reason is None:
                role, event = await queue.get()
                self._dispatch(role, event)
        finally:
            for conn in conns:
                if not conn.broken:
                    conn.send(self.sid, _cancel(conn.role, self.sid))
            self._finish_stats(conns)
            for conn in conns:
                conn.unregister(self.sid)
        return GenerationResult(list(self.request.prompt_ids), self.generated, self.finish_reason, self.stats)

    def _start(self) -> None:
        r = self.request
        start = pb.StartSession(
            session_id=self.sid, prompt_ids=r.prompt_ids, sampling=convert.sampling_to_proto(r.sampling),
            stop_token_ids=sorted(self.stop_ids), max_new_tokens=r.max_new_tokens, pipeline=PIPELINES[self.pipeline],
        )
        self.target.send(self.sid, pb.TargetRequest(start=start))
        if self.draft is None:
            self._verify(self._empty_block())
            return
        start.policy.CopyFrom(convert.policy_to_proto(r.policy))
        self.draft.send(self.sid, pb.DraftRequest(start=start))

    def _dispatch(self, role: str, event) -> None:
        if event is BROKEN:
            conn = self.target if role == "target" else self.draft
            raise WorkerUnavailable(conn.broken or f"{role} worker went away")
        kind = event.WhichOneof("kind")
        if kind == "error":
            err = event.error
            cls = InvalidRequest if err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] else WorkerError
            raise cls(f"{role} worker: {err.message}")
        if kind == "block":
            self._on_block(event.block)
        elif kind == "verdict":
            self._on_verdict(event.verdict)

    def _on_block(self, block: pb.Block) -> None:
        self.intervals.append(("draft", block.started_at, block.finished_at))
        if block.epoch != self.epoch:
            self.stats.discarded_tokens += len(block.tokens)  # drafted on a rolled-back base
            return
        if block.resolved_token != NO_TOKEN:
            self._commit([block.resolved_token])
            if self.finish_reason is not None:
                return
        if self.in_verification is None:
            self._verify(block)
        else:
            self.held = block  # drafted ahead; sent on if the block before it is fully accepted

    def _on_verdict(self, msg: pb.Verdict) -> None:
        self.intervals.append(("target", msg.started_at, msg.finished_at))
        # the coordinator only relays p_row (draft side draws the correction): never decoded here
        block, self.in_verification = self.in_verification, None
        k, accepted = len(block.tokens), msg.accepted
        self._record_round(block, accepted)
        settled = list(block.tokens[:accepted])
        deferred = False
        if accepted < k:
            self.epoch += 1
            if self.held is not None:
                self.stats.discarded_tokens += len(self.held.tokens)
                self.held = None
            token = msg.token
        elif block.followup:
            deferred, token = True, NO_TOKEN  # the held block's first token settles the next place
        else:
            token = msg.token
        if token != NO_TOKEN:
            settled.append(token)
        self._commit(settled)
        if self.finish_reason is not None:
            return
        if self.draft is None:
            self._verify(self._empty_block())
            return
        feedback = pb.Feedback(session_id=self.sid, epoch=self.epoch, base=block.base, drafted=k,
                               accepted=accepted, token=token)
        if msg.HasField("p_row"):
            feedback.p_row.CopyFrom(msg.p_row)
        self.draft.send(self.sid, pb.DraftRequest(feedback=feedback))
        if deferred and self.held is not None:
            held, self.held = self.held, None
            self._verify(held)

    def _verify(self, block: pb.Block) -> None:
        if block.base != len(self.committed):
            raise WorkerError(f"draft worker sent a block at base {block.base}, committed {len(self.committed)}")
        append = self.committed[self.target_known :]
        self.target_known = len(self.committed)
        self.in_verification = block
        self.target.send(self.sid, pb.TargetRequest(verify=pb.VerifyBlock(block=block, append=append)))

    def _empty_block(self) -> pb.Block:
        return pb.Block(session_id=self.sid, epoch=self.epoch, base=len(self.committed))

    def _commit(self, tokens: list[int]) -> None:
        budget = self.request.max_new_tokens - len(self.generated)
        tokens, self.finish_reason = clip_settled(tokens, budget, self.stop_ids)
        self.committed += tokens
        self.generated += tokens
        # the caller may end the output here (an API stop string): finish as a stop
        if tokens and self.on_tokens is not None and self.on_tokens(tokens) and self.finish_reason is None:
            self.finish_reason = "stop"

    def _record_round(self, block: pb.Block, accepted: int) -> None:
        s = self.stats
        s.rounds += 1
        s.target_forwards += 1
        s.draft_tokens += len(block.tokens)
        s.accepted_tokens += accepted
        s.draft_lengths.append(len(block.tokens))
        s.accepted_lengths.append(accepted)
        if block.tokens and block.HasField("entropies"):
            s.stop_entropies.append(float(convert.tensor_from_proto(block.entropies)[-1]))

    def _finish_stats(self, conns: list[WorkerConnection]) -> None:
        s = self.stats
        end = time.time()
        s.wall_s = end - self.started
        s.draft_forwards = s.draft_tokens + s.discarded_tokens
        draft = [(a, b) for w, a, b in self.intervals if w == "draft"]
        target = [(a, b) for w, a, b in self.intervals if w == "target"]
        s.draft_busy_s = sum(b - a for a, b in draft)
        s.target_busy_s = sum(b - a for a, b in target)
        s.both_busy_s = _overlap(draft, target)
        s.draft_wait_s = max(0.0, s.wall_s - s.draft_busy_s) if self.draft is not None else 0.0
        s.target_wait_s = max(0.0, s.wall_s - s.target_busy_s)
        s.wire_bytes = sum(c.bytes_sent[self.sid] + c.bytes_received[self.sid] for c in conns)
        s.wire_bytes_per_round = s.wire_bytes / s.rounds if s.rounds else 0.0
        s.timeline = [(w, a - self.started, b - self.started) for w, a, b in sorted(self.intervals, key=lambda x: x[1])]


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Total time covered by both interval sets (each set's intervals are disjoint)."""
    total, i, j = 0.0, 0, 0
    xs, ys = sorted(xs), sorted(ys)
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def _cancel(role: str, session_id: str):
    cancel = pb.Cancel(session_id=session_id)
    return pb.TargetRequest(cancel=cancel) if role == "target" else pb.DraftRequest(cancel=cancel)
