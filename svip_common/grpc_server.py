"""What both workers' gRPC servers share: the server itself (loopback by default, explicit
message size limits, the standard health service) and the session-multiplexing stream loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from svip_common.contracts import Limits, check_length, check_prompt_ids, check_token_ids
from svip_common.errors import InvalidRequest, SvipError
from svip_proto import svip_pb2 as pb

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a full-vocabulary float32 row is ~600 KB at 152k tokens
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
log = logging.getLogger(__name__)


async def start_server(register: Callable[[grpc.aio.Server], None], service_name: str, host: str = "127.0.0.1") -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server on host:<free port> with the health service; returns (server, port)."""
    server = grpc.aio.server(options=GRPC_OPTIONS)
    register(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    await health.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port


class Refused(InvalidRequest):
    """A message refused without touching any session: a duplicate start, or a session id that
    belongs to another stream (or to none)."""


class SessionStream:
    """One bidirectional stream carrying many sessions. Requests are handled in order on one
    compute thread (the model is one device), so the event loop stays free to read the stream;
    a bad request ends its own session with an error event, never the stream. A session belongs
    to the stream that started it; events wait in a bounded queue, so a peer that stops reading
    stalls its own stream (gRPC flow control) rather than growing the worker's memory."""

    def __init__(self, service: SessionService, pool: concurrent.futures.Executor):
        self._service = service
        self._pool = pool

    async def run(self, requests: AsyncIterator) -> AsyncIterator:
        out: asyncio.Queue = asyncio.Queue(maxsize=MAX_QUEUED_EVENTS)

        async def consume():
            try:
                async for request in requests:
                    await self._answer(request, out)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the request stream broke")
            await out.put(_END)

        task = asyncio.create_task(consume())
        try:
            while (event := await out.get()) is not _END:
                yield event
        finally:
            task.cancel()
            # the peer went away: free every cache its sessions hold
            await asyncio.get_running_loop().run_in_executor(self._pool, self._service.close_owned, self)

    async def _answer(self, request, out: asyncio.Queue) -> None:
        """Every event one request makes, queued as it is made (a block is verified while the
        next one is drafted); errors become the session's error event."""
        loop, service = asyncio.get_running_loop(), self._service
        session_id = ""
        try:
            session_id = _session_id(request)
            events = service.handle(request, self)
            while (event := await loop.run_in_executor(self._pool, next, events, None)) is not None:
                await out.put(event)
        except Refused as exc:  # nothing of any session is touched
            await out.put(service.error_event(session_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
        except SvipError as exc:
            await out.put(service.error_event(session_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            await loop.run_in_executor(self._pool, service.close_session, session_id, self)
        except Exception:  # a worker bug: report it on the session, keep serving
            log.exception("request failed")
            await out.put(service.error_event(session_id, grpc.StatusCode.INTERNAL, "internal worker error (see the worker's log)"))
            await loop.run_in_executor(self._pool, service.close_session, session_id, self)


_END = object()
MAX_QUEUED_EVENTS = 256  # per stream; a full queue stops reading the peer's requests


def _session_id(request) -> str:
    kind = request.WhichOneof("kind")
    if kind is None:
        raise Refused("empty message: set one of its fields")
    inner = getattr(request, kind)
    if kind == "verify":
        return inner.block.session_id
    return inner.session_id


class SessionService:
    """What both worker services share: the session table (each session owned by the stream
    that started it), one compute thread, the session stream, Stats and cancellation.
    Subclasses implement ``handle`` (request, owner -> events, on the compute thread) and ``error_event``; their
    sessions expose ``cached_tokens``."""

    role = ""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.sessions: dict = {}
        self._owners: dict[str, object] = {}
        self.tokens_processed = 0
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.role)

    async def Session(self, request_iterator, context):
        stream = SessionStream(self, self._pool)
        async for event in stream.run(request_iterator):
            yield event

    async def Stats(self, request, context):
        with self._lock:
            return pb.WorkerStats(
                open_sessions=len(self.sessions),
                cached_tokens=sum(s.cached_tokens for s in self.sessions.values()),
                tokens_processed=self.tokens_processed,
            )

    def _check_start(self, msg: pb.StartSession) -> None:
        """A StartSession within this worker's limits: ids, context, block cap."""
        check_prompt_ids(msg.prompt_ids, self.limits.tokens)
        check_length(len(msg.prompt_ids), msg.max_new_tokens, self.limits.positions)
        check_token_ids(msg.stop_token_ids, self.limits.tokens, "stop token id")

    def _new_session(self, session_id: str, session, owner) -> None:
        with self._lock:
            if session_id in self.sessions:
                raise Refused(f"session {session_id!r} already exists")
            self.sessions[session_id] = session
            self._owners[session_id] = owner

    def _session(self, session_id: str, owner):
        with self._lock:
            if self._owners.get(session_id) is not owner:
                raise Refused(f"no session {session_id!r} on this stream")
            return self.sessions[session_id]

    def close_session(self, session_id: str, owner) -> None:
        with self._lock:
            if self._owners.get(session_id) is owner:
                del self.sessions[session_id], self._owners[session_id]

    def close_owned(self, owner) -> None:
        with self._lock:
            for session_id in [sid for sid, o in self._owners.items() if o is owner]:
                del self.sessions[session_id], self._owners[session_id]

    def handle(self, request, owner):
        raise NotImplementedError

    def error_event(self, session_id: str, code: grpc.StatusCode, message: str):
        raise NotImplementedError
