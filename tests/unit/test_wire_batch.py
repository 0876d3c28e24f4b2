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
