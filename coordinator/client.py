"""The caller's client end of the pipeline: ``WorkerConnection``, one gRPC stream to a target
worker multiplexing sessions (start a session, read its settled tokens), driven from the caller's
event loop; a broken stream is delivered to every open session as WorkerUnavailable, so no caller
hangs. (The target worker's stream to its draft is coordinator/session/draft_link.py.)"""

from __future__ import annotations

import asyncio
import logging

import grpc

from svip_common.errors import WorkerUnavailable
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from svip_runtime.grpc_server import CONNECT_TIMEOUT_S, open_channel
from svip_runtime.tls import TlsFiles

BROKEN = object()

log = logging.getLogger(__name__)


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
