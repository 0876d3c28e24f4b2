"""The target worker's gRPC service: sessions multiplexed on one stream per coordinator."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator
import time
from dataclasses import dataclass

import grpc

from svip_common.errors import InvalidRequest
from svip_common.grpc_server import SessionStream
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from target_worker.verifier import TargetSession, Verifier


@dataclass
class RemoteTarget:
    session: TargetSession
    committed: list[int]  # as settled by the coordinator; never changes, only grows


class TargetService(pb_grpc.TargetWorkerServicer):
    def __init__(self, verifier: Verifier):
        self.verifier = verifier
        self.sessions: dict[str, RemoteTarget] = {}
        self._lock = threading.Lock()
        self.tokens_processed = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="target")

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

    def _handle(self, request: pb.TargetRequest) -> Iterator[pb.TargetEvent]:
        kind = request.WhichOneof("kind")
        vocab = self.verifier.target.vocab_size
        if kind == "start":
            msg = request.start
            if msg.session_id in self.sessions:
                raise InvalidRequest(f"session {msg.session_id!r} already exists")
            if not msg.prompt_ids:
                raise InvalidRequest("prompt is empty")
            _check_ids(msg.prompt_ids, vocab, "prompt token id")
            sampling = convert.sampling_from_proto(msg.sampling)
            with self._lock:
                self.sessions[msg.session_id] = RemoteTarget(self.verifier.open(sampling), list(msg.prompt_ids))
            return
        if kind == "verify":
            msg = request.verify
            remote = self._session(msg.block.session_id)
            _check_ids(msg.append, vocab, "token id")
            _check_ids(msg.block.tokens, vocab, "drafted token id")
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

    def _session(self, session_id: str) -> RemoteTarget:
        session = self.sessions.get(session_id)
        if session is None:
            raise InvalidRequest(f"no session {session_id!r}")
        return session

    def _close(self, session_id: str) -> None:
        with self._lock:
            self.sessions.pop(session_id, None)


def _check_ids(ids, vocab: int, what: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"{what} {bad[0]} is outside the vocabulary [0, {vocab})")


def _error(session_id: str, code: grpc.StatusCode, message: str) -> pb.TargetEvent:
    return pb.TargetEvent(error=pb.Error(session_id=session_id, code=code.value[0], message=message))
