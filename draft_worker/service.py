"""The draft worker's gRPC service: sessions multiplexed on one stream per coordinator."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from draft_worker.drafter import Drafter
from draft_worker.pipelined import Outgoing, PipelinedDraft
from svip_common.contracts import NO_TOKEN, check_token_ids
from svip_common.errors import InvalidRequest
from svip_common.grpc_server import SessionService
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc


class DraftService(SessionService, pb_grpc.DraftWorkerServicer):
    role = "draft"

    def __init__(self, drafter: Drafter, limits):
        super().__init__(limits)
        self.drafter = drafter

    # --- on the compute thread -------------------------------------------------------------
    def handle(self, request: pb.DraftRequest, owner) -> Iterator[pb.DraftEvent]:
        kind = request.WhichOneof("kind")
        if kind == "start":
            msg = request.start
            self._check_start(msg)
            sampling = convert.sampling_from_proto(msg.sampling)
            policy = convert.policy_from_proto(msg.policy, self.limits.max_draft_length)
            stop = frozenset(msg.stop_token_ids)
            session = PipelinedDraft(
                session=self.drafter.open(sampling, policy, tuple(stop)),
                prompt=list(msg.prompt_ids), max_new_tokens=msg.max_new_tokens, stop_token_ids=stop,
                pipelined=msg.pipeline == pb.PIPELINE_ASYNC,
            )
            self._new_session(msg.session_id, session, owner)
            yield from self._events(msg.session_id, session, session.start())
            return
        if kind == "feedback":
            msg = request.feedback
            session = self._session(msg.session_id, owner)
            if msg.token != NO_TOKEN:  # the target's token goes into this model's embedding next
                check_token_ids([msg.token], self.limits.tokens, "feedback token id")
            p_row = convert.tensor_from_proto(msg.p_row) if msg.HasField("p_row") else None
            if p_row is not None and tuple(p_row.shape) != (self.drafter.width,):
                raise InvalidRequest(f"p_row has shape {tuple(p_row.shape)}, expected ({self.drafter.width},)")
            sent = session.on_feedback(msg.epoch, msg.base, msg.drafted, msg.accepted, msg.token, p_row)
            yield from self._events(msg.session_id, session, sent)
            return
        # cancel
        self._session(request.cancel.session_id, owner)
        self.close_session(request.cancel.session_id, owner)
        yield pb.DraftEvent(closed=pb.Closed(session_id=request.cancel.session_id))

    def _events(self, session_id: str, session: PipelinedDraft, sent: Iterator[Outgoing]) -> Iterator[pb.DraftEvent]:
        greedy = session.session.sampling.greedy
        for item in sent:
            self.tokens_processed += len(item.block)
            block = convert.block_to_proto(session_id, item.block, greedy, item.resolved_token)
            block.followup, block.started_at, block.finished_at = item.followup, item.started_at, item.finished_at
            yield pb.DraftEvent(block=block)

    def error_event(self, session_id: str, code: grpc.StatusCode, message: str) -> pb.DraftEvent:
        return pb.DraftEvent(error=pb.Error(session_id=session_id, code=code.value[0], message=message))
