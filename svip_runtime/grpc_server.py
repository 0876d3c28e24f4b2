"""What both workers' gRPC servers share: the server itself (loopback by default, explicit
message size limits, the standard health service) and the session-multiplexing stream loop."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from svip_common import test_hooks
from svip_common.contracts import Limits, check_length, check_prompt_ids, check_token_ids
from svip_common.errors import InvalidRequest, Overloaded, SvipError, WorkerUnavailable
from svip_common.grammar import Grammar
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from svip_runtime.compute_loop import ComputeLoop, Outlet
from svip_runtime.grammar_waits import GrammarWaits
from svip_runtime.tls import TlsFiles
from svip_runtime.wire_batch import Bursts

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a full-vocabulary float32 row is ~600 KB at 152k tokens
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # keepalive: a peer that stops answering (a hung process, a dead node) breaks the stream within
    # ~15 s, so its sessions recover instead of waiting forever; servers accept pings this often
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]
log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def check_bind(host: str, tls: TlsFiles | None, insecure: bool = False) -> None:
    """A worker listens on one address, never the wildcard, and in plaintext on loopback only
    (a direct peer on the network would bypass the API's keys and admission) unless told so."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        raise InvalidRequest("a worker listens on one address: its node's, or 127.0.0.1")
    if tls is None and not insecure and not is_loopback(host):
        raise InvalidRequest(f"refusing to serve worker gRPC in plaintext on {host}, a non-loopback address: give "
                             "the workers mutual TLS (--grpc-tls-dir / grpc_tls_dir), or pass --insecure-workers on "
                             "a network you trust")


async def start_server(register: Callable[[grpc.aio.Server], None], service_name: str, host: str = "127.0.0.1",
                       tls: TlsFiles | None = None, insecure: bool = False) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server on host:<free port> (never the wildcard address; plaintext only on
    loopback unless insecure) with the health service, mutual TLS when tls is given; returns
    (server, port)."""
    check_bind(host, tls, insecure)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    register(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"{host}:0"
    port = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    await server.start()
    await health.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port


class Refused(InvalidRequest):
    """A message refused without touching any session: a duplicate start, or a session id that
    belongs to another stream (or to none)."""


COMPUTE_PROBE_S = 10.0  # Stats: a compute thread silent this long is stuck (a hung kernel, a deadlock)
MAX_SESSIONS_PER_STREAM = 4096  # a peer's stream past it: its new sessions are refused (RESOURCE_EXHAUSTED)
MAX_SESSIONS_PER_WORKER = 8192  # every stream together
MAX_QUEUED_EVENTS = 256  # per stream; past it, the stream's requests are not read
_END = object()


class SessionStream:
    """One bidirectional stream carrying many sessions. Its requests are read on the event loop
    and handled on the service's compute thread in arrival order; the events made for its
    sessions go out in order through its outlet. A session belongs to the stream that started
    it. While MAX_QUEUED_EVENTS events wait to be sent, the stream's requests are not read, so a
    peer that stops reading stalls its own stream (gRPC flow control), not the worker's memory."""

    def __init__(self, service: SessionService):
        self._service = service
        self.outlet = Outlet(asyncio.get_running_loop())
        self.sessions = 0  # open sessions this stream started (the compute thread counts them)
        self._room = asyncio.Event()
        self._read_count = 0  # requests read (the event loop counts them)
        self._handled = 0  # of them, handled (the compute thread counts them)
        self._waiting_for_room = False  # the reader waits: the compute thread wakes it when it frees room
        self._held = 0  # events taken from the outlet's queue, not yet all sent (a burst being sent)
        self.closed = False  # the peer went away (set on the compute thread: close_owned)

    def emit(self, event) -> None:
        """From the compute thread: send an event on this stream."""
        self.outlet.send(event)

    async def run(self, requests: AsyncIterator) -> AsyncIterator:
        compute = self._service.compute
        reader = asyncio.create_task(self._read(requests))
        bursts = Bursts(self.outlet.queue, _END)
        try:
            while True:
                burst, ended = await bursts.take()
                self._held = len(burst) + bursts.held  # out of the queue, still the backlog's until sent
                for message in self._service.pack(burst) if burst else ():
                    yield message
                self._held = bursts.held
                self._check_room()
                if ended:
                    break
        finally:
            reader.cancel()
            self.outlet.close()
            compute.post(self._service.close_owned, self)  # the peer went away: free its caches

    def _handle(self, request, received: float) -> None:
        """On the compute thread: one request, then its place in the backlog is freed (a counter;
        the loop is woken for it only while its reader waits for room)."""
        try:
            self._service.receive(self, request, received)
        finally:
            self._handled += 1
            if self._waiting_for_room:
                self.outlet.loop.call_soon_threadsafe(self._check_room)

    @property
    def _backlog(self) -> int:
        """Requests read and not yet handled, and events made and not yet sent (an event is made
        before its request counts as handled, so the two never miss one between them)."""
        return self._read_count - self._handled + self.outlet.waiting + self._held

    def _check_room(self) -> None:
        if self._backlog < MAX_QUEUED_EVENTS // 2:
            self._room.set()

    async def _read(self, requests: AsyncIterator) -> None:
        compute = self._service.compute
        try:
            async for request in requests:
                received = time.time()
                while self._backlog >= MAX_QUEUED_EVENTS:
                    self._room.clear()
                    self._waiting_for_room = True  # set before the check below: no wake-up is lost
                    if self._backlog >= MAX_QUEUED_EVENTS:
                        await self._room.wait()
                    self._waiting_for_room = False
                self._read_count += 1
                compute.post(self._handle, request, received)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the request stream broke")
        compute.post(self.emit, _END)  # after every event of the requests read


def status_of(exc: SvipError) -> grpc.StatusCode:
    """The gRPC status a worker reports an error with (and the caller maps back)."""
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, WorkerUnavailable):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.INTERNAL


def session_id_of(request) -> str:
    kind = request.WhichOneof("kind")
    if kind is None:
        raise Refused("empty message: set one of its fields")
    return getattr(request, kind).session_id


class SessionService:
    """What the worker services share: the session table (each session owned by the stream that
    started it), the compute thread that owns it, the session streams, Stats and cancellation.
    Subclasses implement ``handle(request, stream, received_at)`` (on the compute thread; events
    go out with ``stream.emit``), ``error_event`` and, for work between messages, ``idle``;
    their sessions expose ``cached_tokens`` and ``close()``."""

    role = ""

    def __init__(self, limits: Limits, compute: Callable[..., ComputeLoop] = ComputeLoop, grammar_tokenizer=None):
        """compute(name, idle=, wake_in=): the loop that owns the sessions (a thread; the in-memory
        transport's ManualLoop runs it by hand); grammar_tokenizer(): the model's tokenizer as
        structured output's matchers read it (grammar_mask.grammar_tokenizer)."""
        self._grammar_tokenizer = grammar_tokenizer
        self.limits = limits
        self.sessions: dict = {}
        self._owners: dict[str, SessionStream] = {}
        self.tokens_processed = 0
        self._lock = threading.Lock()  # Stats reads the table from the event loop
        self.compute_probe_s = COMPUTE_PROBE_S
        self.max_sessions_per_stream, self.max_sessions_per_worker = MAX_SESSIONS_PER_STREAM, MAX_SESSIONS_PER_WORKER
        self.compute = compute(f"{self.role}-compute", idle=self.idle, wake_in=self.idle_wake_in)
        self.grammar_waits = GrammarWaits(self.compute)
        self.test_hooks = test_hooks.announce(self.role)  # none in production; loud when set

    async def close(self) -> None:
        """Stop the compute thread (the actor is shutting down)."""
        await asyncio.get_running_loop().run_in_executor(None, self.compute.stop)

    async def _serve_stream(self, request_iterator):
        stream = SessionStream(self)
        async for event in stream.run(request_iterator):
            yield event

    async def Stats(self, request, context):
        """The worker's load and health; a compute thread that does not answer within
        compute_probe_s makes it unavailable (what a health check reads: the worker is replaced)."""
        with self._lock:
            sessions = list(self.sessions.values())
        pool = self.pool
        replacements, lost = self.draft_state()
        unavailable = self.unavailable() or ""
        if not unavailable and not await self._compute_answers(self.compute_probe_s):
            unavailable = f"the {self.role} worker's compute thread has not answered in {self.compute_probe_s:.0f} s"
        stats = pb.WorkerStats(open_sessions=len(sessions), cached_tokens=sum(s.cached_tokens for s in sessions),
                               tokens_processed=self.processed_tokens(), unavailable=unavailable,
                               kv_pages_used=pool.used_pages, kv_pages_total=pool.pages, kv_page_tokens=pool.page_size,
                               draft_replacements=replacements, draft_lost=lost, test_hooks=self.test_hooks)
        if self.device_timing is not None:
            stats.emulated_device.CopyFrom(convert.device_use_to_proto(self.device_timing))
        self.add_stats(stats)
        return stats

    def add_stats(self, stats: pb.WorkerStats) -> None:
        """What a worker of this kind adds to its stats (nothing by default)."""

    async def _compute_answers(self, timeout_s: float) -> bool:
        """Whether the compute thread runs a no-op within timeout_s (after what is queued)."""
        loop = asyncio.get_running_loop()
        answered = loop.create_future()
        self.compute.post(loop.call_soon_threadsafe, lambda: answered.done() or answered.set_result(True))
        try:
            await asyncio.wait_for(answered, timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def unavailable(self) -> str | None:
        """Why this worker cannot serve sessions now, or None."""
        return None

    def draft_state(self) -> tuple[int, str]:
        """Target: (draft workers replaced so far, why none is connected now or "")."""
        return 0, ""

    def processed_tokens(self) -> int:
        """Draft: tokens drafted and sent; target: drafted tokens verified."""
        return self.tokens_processed

    @property
    def pool(self):
        """The worker's KV pool."""
        raise NotImplementedError

    @property
    def device_timing(self):
        """The worker's device timing on this machine (svip_common/device_timing.py), or None."""
        return getattr(self.pool, "timing", None)

    # --- on the compute thread -----------------------------------------------------------------
    def pack(self, events: list) -> list:
        """The messages that carry a burst of events (the stream's own kind; no batching here)."""
        return events

    def unpack(self, request) -> list:
        """The requests one received message carries (itself here)."""
        return [request]

    def receive(self, stream: SessionStream, message, received_at: float) -> None:
        """One received message: each request it carries handled, or answered with an error event."""
        try:
            requests = self.unpack(message)
        except Refused as exc:
            stream.emit(self.error_event("", grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return
        for request in requests:
            self._receive_one(stream, request, received_at)

    def _receive_one(self, stream: SessionStream, request, received_at: float) -> None:
        """One request of a stream: handled (once its session's grammar is compiled: grammar_waits.py),
        or answered with an error event for its session."""
        session_id = ""
        try:
            session_id = session_id_of(request)
            resume = functools.partial(self._resumed, stream, request, received_at)
            if self.grammar_waits.waits(session_id, self.grammar_needed(request), resume):
                return
            self.handle(request, stream, received_at)
        except Refused as exc:  # nothing of any session is touched
            stream.emit(self.error_event(session_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
        except SvipError as exc:
            stream.emit(self.error_event(session_id, status_of(exc), str(exc)))
            self.close_session(session_id, stream)
        except Exception:  # a worker bug: report it on the session, keep serving
            log.exception("request failed")
            stream.emit(
                self.error_event(session_id, grpc.StatusCode.INTERNAL, "internal worker error (see the worker's log)")
            )
            self.close_session(session_id, stream)

    def _resumed(self, stream: SessionStream, request, received_at: float) -> None:
        """A request that waited for its session's grammar, handled now (unless its stream closed)."""
        if not stream.closed:
            self._receive_one(stream, request, received_at)

    def grammar_needed(self, request) -> tuple | None:
        """The (grammar, llguidance tokenizer) a request's start compiles (None: none, or one past
        its bounds, which handling it refuses by name)."""
        if request.WhichOneof("kind") != "start" or self._grammar_tokenizer is None:
            return None
        sampling = request.start.sampling
        if not (sampling.grammar_kind or sampling.grammar):
            return None
        grammar = Grammar(sampling.grammar_kind, sampling.grammar)
        try:
            grammar.check_bounds()
        except InvalidRequest:
            return None
        tokenizer = self._grammar_tokenizer()
        return None if tokenizer is None else (grammar, tokenizer)

    def check_start(self, msg: pb.StartSession) -> None:
        """A StartSession within this worker's limits: ids, context, block cap."""
        check_prompt_ids(msg.prompt_ids, self.limits.tokens)
        check_length(len(msg.prompt_ids), msg.max_new_tokens, self.limits.positions, self.limits.kv_tokens)
        check_token_ids(msg.stop_token_ids, self.limits.tokens, "stop token id")
        check_token_ids(msg.sampling.logit_bias_ids, self.limits.tokens, "logit_bias token id")

    def admit(self, session_id: str, owner: SessionStream) -> None:
        """Before a session is made: a new id, within the caps per stream and per worker (each
        session, even a paused one, holds its prompt); Overloaded refuses this session alone."""
        if session_id in self.sessions:
            raise Refused(f"session {session_id!r} already exists")
        if len(self.sessions) >= self.max_sessions_per_worker:
            raise Overloaded(f"the {self.role} worker holds {len(self.sessions)} sessions, its limit")
        if owner.sessions >= self.max_sessions_per_stream:
            raise Overloaded(f"this stream holds {owner.sessions} sessions, the limit per stream")

    def new_session(self, session_id: str, session, owner: SessionStream) -> None:
        if session_id in self.sessions:
            raise Refused(f"session {session_id!r} already exists")
        owner.sessions += 1
        with self._lock:
            self.sessions[session_id] = session
            self._owners[session_id] = owner

    def session(self, session_id: str, owner: SessionStream):
        if self._owners.get(session_id) is not owner:
            raise Refused(f"no session {session_id!r} on this stream")
        return self.sessions[session_id]

    def owner(self, session_id: str) -> SessionStream:
        return self._owners[session_id]

    def close_session(self, session_id: str, owner: SessionStream) -> None:
        if self._owners.get(session_id) is owner:
            with self._lock:
                session = self.sessions.pop(session_id)
                del self._owners[session_id]
            owner.sessions -= 1
            self.release(session_id, session)

    def release(self, session_id: str, session) -> None:
        """A session closed here gives back what it holds."""
        session.close()

    def close_owned(self, owner: SessionStream) -> None:
        owner.closed = True  # what waits for a grammar on it is dropped, not started
        for session_id in [sid for sid, o in self._owners.items() if o is owner]:
            self.close_session(session_id, owner)

    def handle(self, request, stream: SessionStream, received_at: float) -> None:
        raise NotImplementedError

    def error_event(self, session_id: str, code: grpc.StatusCode, message: str):
        raise NotImplementedError

    def idle(self) -> bool:
        """One unit of work between messages (speculation); False when there is none."""
        return False

    def idle_wake_in(self) -> float | None:
        """Where idle() had nothing to do now but will at a known time, the seconds until then
        (the compute loop calls it again then, posted or not); None: only when something is posted."""
        return None


CONNECT_TIMEOUT_S = 10.0


async def open_channel(role: str, address: str, tls: TlsFiles | None) -> grpc.aio.Channel:
    """A channel to a worker, ready (or WorkerUnavailable); mutual TLS when tls is given."""
    if tls is None:
        channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
    else:
        channel = grpc.aio.secure_channel(
            address, tls.channel_credentials(), options=GRPC_OPTIONS + tls.channel_options()
        )
    try:
        await asyncio.wait_for(channel.channel_ready(), CONNECT_TIMEOUT_S)
    except asyncio.TimeoutError:
        await channel.close()
        raise WorkerUnavailable(f"{role} worker at {address} is unreachable") from None
    except BaseException:  # the caller went away (cancelled) while it connected: the channel goes too
        await channel.close()
        raise
    return channel


async def draft_stats(address: str, tls: TlsFiles | None = None) -> pb.WorkerStats:
    """A draft worker's Stats, over a channel of its own (never on a round's path)."""
    channel = await open_channel("draft", address, tls)
    try:
        return await pb_grpc.DraftWorkerStub(channel).Stats(pb.StatsRequest(), timeout=CONNECT_TIMEOUT_S)
    finally:
        await channel.close()
