"""The target worker's gRPC service: sessions multiplexed on one stream per coordinator."""

from __future__ import annotations

from collections.abc import Iterator
import time
from dataclasses import dataclass

import grpc

from svip_common.errors import InvalidRequest
from svip_common.grpc_server import SessionService, check_prompt, check_token_ids
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from target_worker.verifier import TargetSession, Verifier


@dataclass
class RemoteTarget:
    session: TargetSession
    committed: list[int]  # as settled by the coordinator; never changes, only grows

    @property
    def cached_tokens(self) -> int:
        return self.session.cached_tokens


class TargetService(SessionService, pb_grpc.TargetWorkerServicer):
    role = "target"

    def __init__(self, verifier: Verifier):
        super().__init__()
        self.verifier = verifier

    def _handle(self, request: pb.TargetRequest) -> Iterator[pb.TargetEvent]:
        kind = request.WhichOneof("kind")
        vocab = self.verifier.target.vocab_size
        if kind == "start":
            msg = request.start
            check_prompt(msg.prompt_ids, vocab)
            sampling = convert.sampling_from_proto(msg.sampling)
            self._new_session(msg.session_id, RemoteTarget(self.verifier.open(sampling), list(msg.prompt_ids)))
            return
        if kind == "verify":
            msg = request.verify
            remote = self._session(msg.block.session_id)
            check_token_ids(msg.append, vocab)
            check_token_ids(msg.block.tokens, vocab, "drafted token id")
            block = convert.block_from_proto(msg.block)
            if len(remote.committed) + len(msg.append) != block.base:
                raise InvalidRequest(
                    f"block base {block.base} does not follow the {len(remote.committed)} committed + "
                    f"{len(msg.append)} appended tokens"
                )
            if not remote.session.sampling.greedy and len(block.probs) != len(block):
                raise InvalidRequest("a sampled block needs q(d) for every drafted token")
            remote.committed.extend(msg.append)
            started = time.time()
            verdict = remote.session.verify(remote.committed, block)
            self.tokens_processed += len(block)
            out = convert.verdict_to_proto(msg.block.session_id, verdict)
            out.started_at, out.finished_at = started, time.time()
            yield pb.TargetEvent(verdict=out)
            return
        if kind == "cancel":
            self._close(request.cancel.session_id)
            yield pb.TargetEvent(closed=pb.Closed(session_id=request.cancel.session_id))
            return
        raise InvalidRequest("empty target request")

    def _error_event(self, session_id: str, code: grpc.StatusCode, message: str) -> pb.TargetEvent:
        return pb.TargetEvent(error=pb.Error(session_id=session_id, code=code.value[0], message=message))
