"""The target worker's stream to its draft worker: ``DraftLink``, one gRPC stream multiplexing the
sessions, written from the target's compute thread (thread-safe, never blocking) and read on its
event loop. Runs in the target worker's process (coordinator/session/draft_port.py owns it).

The stream carries serialised messages both ways: what is sent is serialised by the sender
(DraftPort, on the compute thread) and what is read arrives with its length, so the sessions'
wire-byte statistics cost no second serialisation. What a step sends together goes as one
message each way (svip_runtime/wire_batch.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from svip_proto import svip_pb2 as pb
from svip_runtime.compute_loop import Outlet
from svip_runtime.grpc_server import open_channel
from svip_runtime.tls import TlsFiles
from svip_runtime.wire_batch import BadBatch, Bursts, pack_requests, unpack

log = logging.getLogger(__name__)
_SERVICE = pb.DESCRIPTOR.services_by_name["DraftWorker"]
SESSION_METHOD = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['Session'].name}"  # as the generated stub names it


def _as_is(data: bytes) -> bytes:
    return data


def _event_and_size(data: bytes) -> tuple[pb.DraftEvent, int]:
    return pb.DraftEvent.FromString(data), len(data)


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
        self.sent_batches = 0  # messages that carried more than one request (one step's, to several sessions)

    async def open(self) -> None:
        self._channel = await open_channel(self.role, self.address, self._tls)
        self._outlet = Outlet(asyncio.get_running_loop())
        session = self._channel.stream_stream(SESSION_METHOD, request_serializer=_as_is,
                                              response_deserializer=_event_and_size)
        self._call = session(self._requests())
        self._reader = asyncio.create_task(self._read())

    def send(self, session_id: str, request: bytes) -> None:
        """A serialised DraftRequest."""
        self._outlet.send(request)

    async def _requests(self):
        """What the compute thread sent, a burst (one step's, for every session) as one message."""
        bursts = Bursts(self._outlet.queue, None)
        while True:
            burst, ended = await bursts.take()
            if burst:
                self.sent_batches += len(burst) > 1
                yield pack_requests(burst)
            if ended:
                return

    async def _read(self) -> None:
        try:
            async for message, size in self._call:
                received_at = time.time()
                for event, event_size in unpack(message, pb.DraftEvent, size):
                    self._on_event(event, received_at, event_size)
            reason = f"draft worker at {self.address} closed the stream"
        except BadBatch as exc:
            reason = f"draft worker at {self.address} sent a malformed batch ({exc})"
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
