"""The two client ends of the pipeline's gRPC streams, each one stream multiplexing sessions:

- ``WorkerConnection``: the caller's stream to a target worker (start a session, read its settled
  tokens), driven from the caller's event loop; a broken stream is delivered to every open
  session as WorkerUnavailable, so no caller hangs.
- ``DraftLink``: a target worker's stream to its draft worker, written from the target's compute
  thread (thread-safe, never blocking) and read on its event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from svip_common.compute_loop import Outlet
from svip_common.errors import WorkerUnavailable
from svip_common.grpc_server import GRPC_OPTIONS
from svip_common.tls import TlsFiles
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc

CONNECT_TIMEOUT_S = 10.0
BROKEN = object()

log = logging.getLogger(__name__)


async def open_channel(role: str, address: str, tls: TlsFiles | None) -> grpc.aio.Channel:
    """A channel to a worker, ready (or WorkerUnavailable); mutual TLS when tls is given."""
    if tls is None:
        channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
    else:
        channel = grpc.aio.secure_channel(address, tls.channel_credentials(), options=GRPC_OPTIONS + tls.channel_options())
    try:
        await asyncio.wait_for(channel.channel_ready(), CONNECT_TIMEOUT_S)
    except asyncio.TimeoutError:
        await channel.close()
        raise WorkerUnavailable(f"{role} worker at {address} is unreachable") from None
    return channel


class WorkerConnection:
    """The caller's stream to a target worker."""

    role = "target"

    def __init__(self, address: str, tls: TlsFiles | None = None):
        self.address, self._tls = address, tls
        self._queues: dict[str, asyncio.Queue] = {}
        self._broken: str | None = None

    async def open(self) -> None:
        self._channel = await open_channel(self.role, self.address, self._tls)
        self.stub = pb_grpc.TargetWorkerStub(self._channel)
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._call = self.stub.Generate(self._requests())
        self._reader = asyncio.create_task(self._read())

    async def _requests(self):
        while (request := await self._outbox.get()) is not None:
            yield request

    async def _read(self) -> None:
        try:
            async for event in self._call:
                queue = self._queues.get(getattr(event, event.WhichOneof("kind")).session_id)
                if queue is not None:  # a late event of an ended session is dropped
                    queue.put_nowait(event)
            self._broken = f"{self.role} worker at {self.address} closed the stream"
        except grpc.aio.AioRpcError as exc:
            self._broken = f"{self.role} worker at {self.address} is unavailable ({exc.code().name}: {exc.details()})"
        except asyncio.CancelledError:
            self._broken = f"{self.role} connection closed"
            raise
        finally:
            for queue in self._queues.values():
                queue.put_nowait(BROKEN)

    def register(self, session_id: str, queue: asyncio.Queue) -> None:
        self._queues[session_id] = queue

    def unregister(self, session_id: str) -> None:
        self._queues.pop(session_id, None)

    def send(self, request: pb.GenerateRequest) -> None:
        if self._broken:
            raise WorkerUnavailable(self._broken)
        self._outbox.put_nowait(request)

    @property
    def broken(self) -> str | None:
        return self._broken

    async def stats(self) -> pb.WorkerStats:
        return await self.stub.Stats(pb.StatsRequest(), timeout=CONNECT_TIMEOUT_S)

    async def close(self) -> None:
        if hasattr(self, "_outbox"):
            self._outbox.put_nowait(None)
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        if hasattr(self, "_channel"):
            await self._channel.close()


async def draft_stats(address: str, tls: TlsFiles | None = None) -> pb.WorkerStats:
    """A draft worker's Stats, over a channel of its own (never on a round's path)."""
    channel = await open_channel("draft", address, tls)
    try:
        return await pb_grpc.DraftWorkerStub(channel).Stats(pb.StatsRequest(), timeout=CONNECT_TIMEOUT_S)
    finally:
        await channel.close()


class DraftLink:
    """A target worker's stream to its draft worker. ``send`` may be called from any thread;
    every event read calls on_event(event, received_at, size) on the event loop, and a broken
    stream calls on_broken(reason) once."""

    role = "draft"

    def __init__(self, address: str, on_event: Callable[[pb.DraftEvent, float, int], None],
                 on_broken: Callable[[str], None], tls: TlsFiles | None = None):
        self.address, self._tls = address, tls
        self._on_event, self._on_broken = on_event, on_broken
        self.broken: str | None = None

    async def open(self) -> None:
        self._channel = await open_channel(self.role, self.address, self._tls)
        self._outlet = Outlet(asyncio.get_running_loop())
        self._call = pb_grpc.DraftWorkerStub(self._channel).Session(self._requests())
        self._reader = asyncio.create_task(self._read())

    def send(self, session_id: str, request: pb.DraftRequest) -> None:
        self._outlet.send(request)

    async def _requests(self):
        while (request := await self._outlet.queue.get()) is not None:
            yield request

    async def _read(self) -> None:
        try:
            async for event in self._call:
                self._on_event(event, time.time(), event.ByteSize())
            reason = f"draft worker at {self.address} closed the stream"
        except grpc.aio.AioRpcError as exc:
            reason = f"draft worker at {self.address} is unavailable ({exc.code().name}: {exc.details()})"
        except asyncio.CancelledError:
            self.broken = "draft link closed"
            raise
        except Exception as exc:  # noqa: BLE001 - whatever broke the stream, the sessions go on without it
            log.exception("the draft link broke")
            reason = f"draft link to {self.address} broke ({type(exc).__name__})"
        self.broken = reason
        self._on_broken(reason)

    async def close(self) -> None:
        if hasattr(self, "_outlet"):
            self._outlet.send(None)
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
            await self._channel.close()
