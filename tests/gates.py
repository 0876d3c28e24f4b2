"""Holding what a test must hold by construction: a gate on every target worker's batched
verification (svip_common/test_hooks.py), and waits for a condition whose deadline only bounds a
failure, never stands in for the condition."""

from __future__ import annotations

import asyncio
import contextlib
import time

from svip_common import test_hooks


class TargetGate:
    """A test's hold on every target worker of this test session: `with gate.held(steps):` lets
    that many more batched verifications run, then holds the next until the block ends (or
    `release()`); `grant(n)` lets n more run from now; `holding()` says whether a worker is holding one back now."""

    name = "target"

    def __init__(self, root: str):
        self.root = root

    @contextlib.contextmanager
    def held(self, steps: int = 0):
        test_hooks.hold(self.root, self.name, steps)
        try:
            yield self
        finally:
            self.release()

    def grant(self, steps: int = 1) -> None:
        """Inside `held`: let `steps` more verifications run from now, then hold again."""
        test_hooks.hold(self.root, self.name, steps)

    def release(self) -> None:
        test_hooks.release(self.root, self.name)

    def holding(self) -> bool:
        return test_hooks.holding(self.root, self.name)


def wait_until(predicate, timeout_s: float = 300.0, what: str = "the condition") -> None:
    """Until predicate() holds (the deadline only bounds a failure: it never stands in for the condition)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not come about in {timeout_s:.0f} s"
        time.sleep(0.01)


async def async_wait_until(predicate, timeout_s: float = 300.0, what: str = "the condition") -> None:
    """wait_until for coroutines: predicate is an async callable."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"{what} did not come about in {timeout_s:.0f} s"
        await asyncio.sleep(0.01)
