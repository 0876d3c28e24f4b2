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


class SessionStream:
    """One bidirectional stream carrying many sessions. Requests are handled in order on one
    compute thread (the model is one device), so the event loop stays free to read the stream;
    a bad request ends its own session with an error event, never the stream."""

    def __init__(self, handle, close_session, error_event, pool: concurrent.futures.Executor):
        self._handle = handle  # request -> iterator of events, advanced on the compute thread
        self._close_session = close_session  # session_id -> None
        self._error_event = error_event  # (session_id, grpc.StatusCode, message) -> event
        self._pool = pool
        self._sessions: set[str] = set()

    async def run(self, requests: AsyncIterator) -> AsyncIterator:
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()

        async def consume():
            try:
                async for request in requests:
                    session_id = _session_id(request)
                    self._sessions.add(session_id)
                    try:
                        # each event goes out as soon as it is made (a block is verified while
                        # the next one is drafted)
                        events = self._handle(request)
                        while (event := await loop.run_in_executor(self._pool, next, events, None)) is not None:
                            out.put_nowait(event)
                    except SvipError as exc:
                        out.put_nowait(self._error_event(session_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
                        await loop.run_in_executor(self._pool, self._close_session, session_id)
                    except Exception as exc:  # a worker bug: report it on the session, keep serving
                        log.exception("request failed")
                        out.put_nowait(self._error_event(session_id, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
                        await loop.run_in_executor(self._pool, self._close_session, session_id)
            finally:
                out.put_nowait(None)

        task = asyncio.create_task(consume())
        try:
            while (event := await out.get()) is not None:
                yield event
        finally:
            task.cancel()
            for session_id in self._sessions:  # the coordinator went away: free every cache
                await loop.run_in_executor(self._pool, self._close_session, session_id)


def _session_id(request) -> str:
    kind = request.WhichOneof("kind")
    inner = getattr(request, kind)
    if kind == "verify":
        return inner.block.session_id
    return inner.session_id


def check_token_ids(ids, vocab: int, what: str = "token id") -> None:
    """A message's token ids against the model's width: the worker's InvalidRequest, never an index error."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"{what} {bad[0]} is outside the vocabulary [0, {vocab})")


def check_prompt(ids, vocab: int) -> None:
    if not ids:
        raise InvalidRequest("prompt is empty")
    check_token_ids(ids, vocab, "prompt token id")


class SessionService:
    """What both worker services share: the session table, one compute thread, the session
    stream, Stats and cancellation. Subclasses implement ``_handle`` (request -> events) and
    ``_error_event``; their sessions expose ``cached_tokens``."""

    role = ""

    def __init__(self):
        self.sessions: dict = {}
        self.tokens_processed = 0
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.role)

    async def Session(self, request_iterator, context):
        stream = SessionStream(self._handle, self._close, self._error_event, self._pool)
        async for event in stream.run(request_iterator):
            yield event

    async def Stats(self, request, context):
        with self._lock:
            return pb.WorkerStats(
                open_sessions=len(self.sessions),
                cached_tokens=sum(s.cached_tokens for s in self.sessions.values()),
                tokens_processed=self.tokens_processed,
            )

    def _new_session(self, session_id: str, session) -> None:
        with self._lock:
            if session_id in self.sessions:
                raise InvalidRequest(f"session {session_id!r} already exists")
            self.sessions[session_id] = session

    def _session(self, session_id: str):
        session = self.sessions.get(session_id)
        if session is None:
            raise InvalidRequest(f"no session {session_id!r}")
        return session

    def _close(self, session_id: str) -> None:
        with self._lock:
            self.sessions.pop(session_id, None)

    def _handle(self, request):
        raise NotImplementedError

    def _error_event(self, session_id: str, code: grpc.StatusCode, message: str):
        raise NotImplementedError
