"""Bursts on the draft link: what waits goes as one message, never past the byte budget, however
large the item that comes after a full burst (the review's N2 residual: 16 MiB of burst plus one
large item once went over gRPC's 64 MiB)."""

from __future__ import annotations

import asyncio

import svip_runtime.wire_batch as wire_batch
from svip_runtime.wire_batch import Bursts

END = object()


def bursts_of(sizes: list[int], budget: int, monkeypatch) -> list[list[int]]:
    monkeypatch.setattr(wire_batch, "MAX_BURST_BYTES", budget)

    async def run():
        queue = asyncio.Queue()
        for size in sizes:
            queue.put_nowait(b"x" * size)
        queue.put_nowait(END)
        bursts, out = Bursts(queue, END), []
        while True:
            burst, ended = await bursts.take()
            if burst:
                out.append([len(item) for item in burst])
            if ended:
                return out

    return asyncio.run(run())


def test_an_item_that_would_take_a_burst_past_the_budget_starts_the_next(monkeypatch):
    assert bursts_of([10, 5, 60, 1, 2], budget=16, monkeypatch=monkeypatch) == [[10, 5], [60], [1, 2]]
    assert bursts_of([3] * 10, budget=16, monkeypatch=monkeypatch) == [[3] * 5, [3] * 5]
    assert bursts_of([], budget=16, monkeypatch=monkeypatch) == []


def test_a_burst_holds_at_most_max_batch_messages(monkeypatch):
    sizes = [1] * (wire_batch.MAX_BATCH + 3)
    assert [len(b) for b in bursts_of(sizes, budget=1 << 20, monkeypatch=monkeypatch)] == [wire_batch.MAX_BATCH, 3]


def split_of(sizes: list[int], budget: int, monkeypatch) -> list[list[int]]:
    monkeypatch.setattr(wire_batch, "MAX_BURST_BYTES", budget)
    return [[len(item) for item in burst] for burst in wire_batch.split_bursts([b"x" * size for size in sizes])]


def test_items_a_sender_has_at_once_split_as_a_queue_would(monkeypatch):
    """split_bursts (the in-memory links) makes the bursts Bursts.take makes of the same items."""
    for sizes, budget in (([10, 5, 60, 1, 2], 16), ([3] * 10, 16), ([], 16), ([60], 16), ([1] * 600, 1 << 20),
                          ([1] * wire_batch.MAX_BATCH, 1 << 20)):
        assert split_of(sizes, budget, monkeypatch) == bursts_of(sizes, budget, monkeypatch), sizes


def test_a_draft_step_of_more_events_than_a_batch_holds_reaches_the_target_whole():
    """A draft step at many sessions may send more than MAX_BATCH events (a block, prepared
    continuations and growths for each): the in-memory link sends them in bursts, as a worker's
    stream does, each a batch the target takes apart, in order (once one batch of 272 was refused)."""
    from coordinator.in_memory import MemoryStream, Wire
    from svip_proto import svip_pb2 as pb
    from svip_runtime.wire_batch import MAX_BATCH, pack_events, unpack

    stream, wire = MemoryStream(lambda events: [pack_events(events).SerializeToString()]), Wire()
    sent = [pb.DraftEvent(closed=pb.Closed(session_id=f"s{i}")) for i in range(2 * MAX_BATCH + 16)]
    for event in sent:
        stream.emit(event)
    stream.flush(wire)
    messages = wire.take()
    assert len(messages) == 3
    got = [event for data in messages for event, _ in unpack(pb.DraftEvent.FromString(data), pb.DraftEvent)]
    assert got == sent
