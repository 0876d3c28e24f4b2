"""The draft worker's gRPC service: sessions multiplexed on one stream per coordinator."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator

import grpc

from draft_worker.drafter import Drafter
from draft_worker.pipelined import Outgoing, PipelinedDraft
from svip_common.errors import InvalidRequest
from svip_common.grpc_server import SessionStream
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc


class DraftService(pb_grpc.DraftWorkerServicer):
    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.sessions: dict[str, PipelinedDraft] = {}
        self._lock = threading.Lock()
        self.tokens_processed = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")

    async def Session(self, request_iterator, context):
        stream = SessionStream(self._handle, self._close, _error, self._pool)
        async for event in stream.run(request_iterator):
            yield event

    async def Stats(self, request, context):
        with self._lock:
            return pb.WorkerStats(
                open_sessions=len(self.sessions),
                cached_tokens=sum(s.session.cached_tokens for s in self.sessions.values()),
                tokens_processed=self.tokens_processed,
            )

    # --- on the compute thread -------------------------------------------------------------
    def _handle(self, request: pb.DraftRequest) -> Iterator[pb.DraftEvent]:
        kind = request.WhichOneof("kind")
        if kind == "start":
            msg = request.start
            if msg.session_id in self.sessions:
                raise InvalidRequest(f"session {msg.session_id!r} already exists")
            if not msg.prompt_ids:
                raise InvalidRequest("prompt is empty")
            sampling = convert.sampling_from_proto(msg.sampling)
            policy = convert.policy_from_proto(msg.policy)
            stop = frozenset(msg.stop_token_ids)
            bad = [t for t in msg.prompt_ids if not 0 <= t < self.drafter.width]
            if bad:
                raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.drafter.width})")
            if msg.max_new_tokens < 1:
                raise InvalidRequest(f"max_new_tokens must be >= 1, got {msg.max_new_tokens}")
            session = PipelinedDraft(
                session=self.drafter.open(sampling, policy, tuple(stop)),
                prompt=list(msg.prompt_ids), max_new_tokens=msg.max_new_tokens, stop_token_ids=stop,
                pipelined=msg.pipeline == pb.PIPELINE_ASYNC,
            )
            with self._lock:
                self.sessions[msg.session_id] = session
            yield from self._events(msg.session_id, session, session.start())
            return
        if kind == "feedback":
            msg = request.feedback
            session = self._session(msg.session_id)
            p_row = convert.tensor_from_proto(msg.p_row) if msg.HasField("p_row") else None
            sent = session.on_feedback(msg.epoch, msg.base, msg.drafted, msg.accepted, msg.token, p_row)
            yield from self._events(msg.session_id, session, sent)
            return
        if kind == "cancel":
            self._close(request.cancel.session_id)
            yield pb.DraftEvent(closed=pb.Closed(session_id=request.cancel.session_id))
            return
        raise InvalidRequest("empty draft request")

    def _session(self, session_id: str) -> PipelinedDraft:
        session = self.sessions.get(session_id)
        if session is None:
            raise InvalidRequest(f"no session {session_id!r}")
        return session

    def _events(self, session_id: str, session: PipelinedDraft, sent: Iterator[Outgoing]) -> Iterator[pb.DraftEvent]:
        greedy = session.session.sampling.greedy
        for item in sent:
            self.tokens_processed += len(item.block)
            block = convert.block_to_proto(session_id, item.block, greedy, item.resolved_token)
            block.followup, block.started_at, block.finished_at = item.followup, item.started_at, item.finished_at
            yield pb.DraftEvent(block=block)

    def _close(self, session_id: str) -> None:
        with self._lock:
            self.sessions.pop(session_id, None)


def _error(session_id: str, code: grpc.StatusCode, message: str) -> pb.DraftEvent:
    return pb.DraftEvent(error=pb.Error(session_id=session_id, code=code.value[0], message=message))
