"""The draft worker's gRPC service: sessions multiplexed on one stream per coordinator."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from draft_worker.drafter import Drafter
from draft_worker.pipelined import Outgoing, PipelinedDraft
from svip_common.errors import InvalidRequest
from svip_common.grpc_server import SessionService, check_prompt
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc


class DraftService(SessionService, pb_grpc.DraftWorkerServicer):
    role = "draft"

    def __init__(self, drafter: Drafter):
        super().__init__()
        self.drafter = drafter

    # --- on the compute thread -------------------------------------------------------------
    def _handle(self, request: pb.DraftRequest) -> Iterator[pb.DraftEvent]:
        kind = request.WhichOneof("kind")
        if kind == "start":
            msg = request.start
            check_prompt(msg.prompt_ids, self.drafter.width)
            sampling = convert.sampling_from_proto(msg.sampling)
            policy = convert.policy_from_proto(msg.policy)
            stop = frozenset(msg.stop_token_ids)
            if msg.max_new_tokens < 1:
                raise InvalidRequest(f"max_new_tokens must be >= 1, got {msg.max_new_tokens}")
            session = PipelinedDraft(
                session=self.drafter.open(sampling, policy, tuple(stop)),
                prompt=list(msg.prompt_ids), max_new_tokens=msg.max_new_tokens, stop_token_ids=stop,
                pipelined=msg.pipeline == pb.PIPELINE_ASYNC,
            )
            self._new_session(msg.session_id, session)
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

    def _events(self, session_id: str, session: PipelinedDraft, sent: Iterator[Outgoing]) -> Iterator[pb.DraftEvent]:
        greedy = session.session.sampling.greedy
        for item in sent:
            self.tokens_processed += len(item.block)
            block = convert.block_to_proto(session_id, item.block, greedy, item.resolved_token)
            block.followup, block.started_at, block.finished_at = item.followup, item.started_at, item.finished_at
            yield pb.DraftEvent(block=block)

    def _error_event(self, session_id: str, code: grpc.StatusCode, message: str) -> pb.DraftEvent:
        return pb.DraftEvent(error=pb.Error(session_id=session_id, code=code.value[0], message=message))
