"""The target worker's gRPC service: sessions multiplexed on one stream per coordinator."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from svip_common.contracts import check_token_ids
from svip_common.errors import InvalidRequest
from svip_common.grpc_server import SessionService
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from target_worker.verifier import TargetSession, Verifier


@dataclass
class RemoteTarget:
    session: TargetSession
    committed: list[int]  # as settled by the coordinator; never changes, only grows
    limit: int  # prompt + max_new_tokens: no block reaches past it

    @property
    def cached_tokens(self) -> int:
        return self.session.cached_tokens


class TargetService(SessionService, pb_grpc.TargetWorkerServicer):
    role = "target"

    def __init__(self, verifier: Verifier, limits):
        super().__init__(limits)
        self.verifier = verifier

    def handle(self, request: pb.TargetRequest, owner) -> Iterator[pb.TargetEvent]:
        kind = request.WhichOneof("kind")
        if kind == "start":
            msg = request.start
            self._check_start(msg)
            sampling = convert.sampling_from_proto(msg.sampling)
            remote = RemoteTarget(self.verifier.open(sampling), list(msg.prompt_ids), len(msg.prompt_ids) + msg.max_new_tokens)
            self._new_session(msg.session_id, remote, owner)
            return
        if kind == "verify":
            msg = request.verify
            remote = self._session(msg.block.session_id, owner)
            block = convert.block_from_proto(msg.block)
            self._check_block(remote, msg, block)
            remote.committed.extend(msg.append)
            started = time.time()
            verdict = remote.session.verify(remote.committed, block)
            self.tokens_processed += len(block)
            out = convert.verdict_to_proto(msg.block.session_id, verdict)
            out.started_at, out.finished_at = started, time.time()
            yield pb.TargetEvent(verdict=out)
            return
        # cancel
        self._session(request.cancel.session_id, owner)
        self.close_session(request.cancel.session_id, owner)
        yield pb.TargetEvent(closed=pb.Closed(session_id=request.cancel.session_id))

    def _check_block(self, remote: RemoteTarget, msg: pb.VerifyBlock, block) -> None:
        """The wire is not trusted: ids in range, the block on the committed sequence, within
        the block cap and within the session's token budget (hence the context)."""
        check_token_ids(msg.append, self.limits.tokens)
        check_token_ids(block.tokens, self.limits.tokens, "drafted token id")
        if len(remote.committed) + len(msg.append) != block.base:
            raise InvalidRequest(
                f"block base {block.base} does not follow the {len(remote.committed)} committed + "
                f"{len(msg.append)} appended tokens"
            )
        if len(block) > self.limits.max_draft_length:
            raise InvalidRequest(f"a block of {len(block)} tokens exceeds the cap of {self.limits.max_draft_length}")
        if block.base + len(block) + 1 > remote.limit:
            raise InvalidRequest(
                f"a block of {len(block)} tokens at base {block.base} reaches past the session's "
                f"{remote.limit} tokens (prompt + max_new_tokens)"
            )
        if not remote.session.sampling.greedy and len(block.probs) != len(block):
            raise InvalidRequest("a sampled block needs q(d) for every drafted token")

    def error_event(self, session_id: str, code: grpc.StatusCode, message: str) -> pb.TargetEvent:
        return pb.TargetEvent(error=pb.Error(session_id=session_id, code=code.value[0], message=message))
