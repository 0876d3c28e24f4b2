"""The coordinator's side of a worker: one gRPC stream per worker, multiplexing sessions.

Events are routed to each session's queue by session id; a broken stream (worker killed,
unreachable) is delivered to every open session as WorkerUnavailable, so no caller hangs.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import grpc

from svip_common.errors import SvipError
from svip_common.grpc_server import GRPC_OPTIONS

CONNECT_TIMEOUT_S = 10.0
BROKEN = object()


class WorkerUnavailable(SvipError):
    """A worker is down or unreachable."""


class WorkerConnection:
    def __init__(self, role: str, address: str, stub_class):
        self.role, self.address, self._stub_class = role, address, stub_class
        self._queues: dict[str, asyncio.Queue] = {}
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.bytes_received: dict[str, int] = defaultdict(int)
        self._broken: str | None = None

    async def open(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.address, options=GRPC_OPTIONS)
        try:
            await asyncio.wait_for(self._channel.channel_ready(), CONNECT_TIMEOUT_S)
        except asyncio.TimeoutError:
            await self._channel.close()
            raise WorkerUnavailable(f"{self.role} worker at {self.address} is unreachable") from None
        self.stub = self._stub_class(self._channel)
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._call = self.stub.Session(self._requests())
        self._reader = asyncio.create_task(self._read())

    async def _requests(self):
        while (request := await self._outbox.get()) is not None:
            yield request

    async def _read(self) -> None:
        try:
            async for event in self._call:
                kind = event.WhichOneof("kind")
                session_id = getattr(event, kind).session_id
                queue = self._queues.get(session_id)
                if queue is not None:  # a late event of an ended session is dropped, counters and all
                    self.bytes_received[session_id] += event.ByteSize()
                    queue.put_nowait((self.role, event))
            self._broken = f"{self.role} worker at {self.address} closed the stream"
        except grpc.aio.AioRpcError as exc:
            self._broken = f"{self.role} worker at {self.address} is unavailable ({exc.code().name}: {exc.details()})"
        except asyncio.CancelledError:
            self._broken = f"{self.role} connection closed"
            raise
        finally:
            for queue in self._queues.values():
                queue.put_nowait((self.role, BROKEN))

    def register(self, session_id: str, queue: asyncio.Queue) -> None:
        self._queues[session_id] = queue

    def unregister(self, session_id: str) -> None:
        self._queues.pop(session_id, None)
        self.bytes_sent.pop(session_id, None)
        self.bytes_received.pop(session_id, None)

    def send(self, session_id: str, request) -> None:
        if self._broken:
            raise WorkerUnavailable(self._broken)
        if session_id in self._queues:
            self.bytes_sent[session_id] += request.ByteSize()
        self._outbox.put_nowait(request)

    @property
    def broken(self) -> str | None:
        return self._broken

    async def stats(self):
        from svip_proto import svip_pb2 as pb

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
