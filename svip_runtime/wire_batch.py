"""One message per step on the draft link, each way: what a worker's step sends to the other at
once (the target's feedback for every session it verified, the draft's blocks for every session
it drafted) travels as one batch, a DraftRequest or DraftEvent whose ``batch`` holds the
serialised messages in order, instead of one gRPC message (a write, a frame, a wake-up on each
side) per session. A lone message travels as itself. Runs in both workers' event loops (sending)
and on the draft worker's compute thread and the target worker's event loop (receiving)."""

from __future__ import annotations

import asyncio

from google.protobuf.message import DecodeError

from svip_common.errors import InvalidRequest
from svip_proto import svip_pb2 as pb

MAX_BATCH = 256  # messages in one batch: a sender packs at most this many, a receiver refuses more
# a batch stops growing once it holds this many bytes: with every message bounded (target features
# travel in chunks of a few MiB, proto/svip_proto/convert.py), a batch stays far under gRPC's limit
# (svip_runtime/grpc_server.py MAX_MESSAGE_BYTES), however many sessions one step serves
MAX_BURST_BYTES = 16 << 20


class BadBatch(InvalidRequest):
    """A batch that cannot be taken apart: a kind beside it, too many messages, one that is not a
    message of its type, or a batch inside it."""


_NOTHING = object()


class Bursts:
    """A queue's items as bursts: the next item and whatever else already waits (at most MAX_BATCH,
    and never past MAX_BURST_BYTES together: an item that would take a burst past it starts the
    next one, so a burst is one large item at most, never a full burst plus it: the review's N2
    residual), until ``end`` (the stream's last item, not returned). Items are serialised messages
    (bytes) or protobuf messages."""

    def __init__(self, queue: asyncio.Queue, end):
        self.queue, self.end = queue, end
        self._next = _NOTHING  # an item taken that starts the next burst

    @property
    def held(self) -> int:
        """Items taken from the queue for the next burst (0 or 1)."""
        return 0 if self._next is _NOTHING else 1

    async def take(self) -> tuple[list, bool]:
        """The next burst (empty only at the end) and whether the end came after it."""
        first, self._next = self._next, _NOTHING
        if first is _NOTHING:
            first = await self.queue.get()
        if first is self.end:
            return [], True
        burst, size = [first], wire_size(first)
        while len(burst) < MAX_BATCH and not self.queue.empty():
            item = self.queue.get_nowait()
            if item is self.end:
                return burst, True
            if _past_bytes(size, item):
                self._next = item
                break
            burst.append(item)
            size += wire_size(item)
        return burst, False


def split_bursts(items: list) -> list[list]:
    """Items a sender has at once, as the bursts Bursts.take would make of them in a queue: at most
    MAX_BATCH each, never past MAX_BURST_BYTES together (an item that would take a burst past it
    starts the next one)."""
    bursts, burst, size = [], [], 0
    for item in items:
        if burst and (len(burst) == MAX_BATCH or _past_bytes(size, item)):
            bursts.append(burst)
            burst, size = [], 0
        burst.append(item)
        size += wire_size(item)
    return bursts + [burst] if burst else bursts


def _past_bytes(size: int, item) -> bool:
    """Whether the item takes a burst of ``size`` bytes past MAX_BURST_BYTES."""
    return size + wire_size(item) > MAX_BURST_BYTES


def wire_size(item) -> int:
    """A serialised message's bytes, or a protobuf message's serialised size."""
    return len(item) if isinstance(item, bytes) else item.ByteSize()


def pack_requests(serialised: list[bytes]) -> bytes:
    """Serialised DraftRequests as one serialised message (a lone one as itself)."""
    return serialised[0] if len(serialised) == 1 else pb.DraftRequest(batch=serialised).SerializeToString()


def pack_events(events: list[pb.DraftEvent]) -> pb.DraftEvent:
    """DraftEvents as one message (a lone one as itself)."""
    return events[0] if len(events) == 1 else pb.DraftEvent(batch=[e.SerializeToString() for e in events])


def unpack(message, kind: type, size: int = 0) -> list[tuple[object, int]]:
    """The messages a received one (of ``size`` bytes) carries, each with its size on the wire:
    itself, or a batch's."""
    if not message.batch:
        return [(message, size)]
    if message.WhichOneof("kind") is not None:
        raise BadBatch(f"a batch sets no kind, this one sets {message.WhichOneof('kind')!r}")
    if len(message.batch) > MAX_BATCH:
        raise BadBatch(f"a batch holds at most {MAX_BATCH} messages, this one {len(message.batch)}")
    out = []
    for raw in message.batch:
        try:
            item = kind.FromString(raw)
        except DecodeError:
            raise BadBatch(f"a batch item is not a {kind.__name__}") from None
        if item.batch:
            raise BadBatch("a batch inside a batch")
        out.append((item, len(raw)))
    return out
