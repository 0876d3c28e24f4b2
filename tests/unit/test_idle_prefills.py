"""What the target does while it idles, waiting on blocks (coordinator/session/idle_work.py): a fill
(the target's own token from a row stored already) for every greedy session waiting on its draft,
at any session count; a forward that takes in the sessions' next rows ahead (a prefill) where what
they save exceeds what it holds up the blocks due meanwhile (``prefills_that_pay``). The rule
itself, then IdleWork over stand-in sessions whose waits and gains the test sets (no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from coordinator.session.idle_work import IdleWork
from svip_common.step_cost import StepCost, prefills_that_pay


class Cost(StepCost):
    """A forward's time as the test sets it: fixed + per_item x tokens, observed."""

    def __init__(self, fixed: float = 0.010, per_item: float = 0.001, observed: bool = True):
        super().__init__()
        self._fixed, self._per, self._seen = fixed, per_item, observed

    fixed = property(lambda self: self._fixed)
    per_item = property(lambda self: self._per)
    observed = property(lambda self: self._seen)


def test_a_lone_session_prefills_where_its_block_comes_later_than_a_one_token_forward():
    cost = Cost()  # F(1) = 11 ms
    assert prefills_that_pay([(1, 0.004)], [0.020], cost) == [0]  # the forward ends before the block: free
    assert prefills_that_pay([(1, 0.004)], [0.009], cost) == [0]  # holds it up 2 ms, saves 4
    assert prefills_that_pay([(1, 0.004)], [0.0], cost) == []  # holds it up 11 ms, saves 4
    assert prefills_that_pay([(1, 0.004)], [0.020], Cost(observed=False)) == []  # nothing measured yet


def test_with_several_sessions_a_forward_that_holds_up_a_block_due_now_does_not_run():
    cost = Cost()
    far = [0.030, 0.030, 0.030]
    assert prefills_that_pay([(1, 0.004), (1, 0.004)], far, cost) == [0, 1]  # ends before any block: free
    # a third session's block is due now: an 11-12 ms forward holds it up more than two rows save
    assert prefills_that_pay([(1, 0.004), (1, 0.004)], far[:2] + [0.0], cost) == []
    # rows that together save more than the hold-up go (11 then 12 ms against 8 then 16)
    assert prefills_that_pay([(1, 0.008), (1, 0.008)], far[:2] + [0.0], cost) == [0, 1]
    # the most a row first, as many as save the most: a long row's 6 ms more is not worth its 4
    assert prefills_that_pay([(1, 0.008), (6, 0.004), (1, 0.008)], far[:2] + [0.0], cost) == [0, 2]


def test_a_prompt_owed_prices_only_what_the_rows_beside_it_add():
    cost = Cost()  # a 40-token prompt: a 50 ms forward owed anyway
    assert prefills_that_pay([(1, 0.002)], [0.0, 0.060], cost, owed=40) == [0]  # adds 1 ms to one block, saves 2
    assert prefills_that_pay([(1, 0.002)], [0.0, 0.0, 0.0], cost, owed=40) == []  # adds 1 ms to three


class Waiting:
    """A session waiting on its draft whose block is due in ``wait`` seconds, lacking its next row
    (``lacks``) that saves ``gain`` seconds if taken in ahead; greedy sessions fill."""

    def __init__(self, wait: float | None, gain: float = 0.004, lacks: bool = True, prompt: bool = False):
        self.wait, self.gain, self.lacks, self.prompt_owed = wait, gain, lacks, prompt
        self.uncached_tokens, self.target, self.committed = 1, object(), [1]
        self.log = SimpleNamespace(busy=lambda *args: None)
        self.filled = 0

    def wants_prefill(self) -> bool:
        return self.lacks

    def block_wait(self, now: float) -> float | None:
        return self.wait

    def prefill_gain(self, verify: StepCost) -> float:
        return self.gain

    def wants_fill(self) -> bool:
        return self.wait is not None

    def fill(self, started: float, ended: float) -> list:
        self.filled += 1
        return []


class Verifier:
    """Takes in the rows asked for, counting them."""

    feature_layers = ()

    def __init__(self, cost: StepCost):
        self.cost, self.taken = cost, []

    def prefill_next(self, jobs, budget=None) -> int:
        self.taken.append(len(jobs))
        return len(jobs)


def idle(sessions: dict, mode: str = "auto") -> tuple[Verifier, IdleWork]:
    verifier = Verifier(Cost())
    work = IdleWork(verifier, mode, None, clock=lambda: 0.0)
    work.run(sessions, {}, lambda sid, event, *args: event(*args))
    return verifier, work


def test_auto_at_several_sessions_fills_each_and_prefills_where_the_blocks_are_far_off():
    sessions = {f"s{i}": Waiting(0.030) for i in range(4)}
    verifier, work = idle(sessions)
    assert verifier.taken == [4] and work.prefills == 4
    assert all(s.filled == 2 for s in sessions.values())  # before the forward (none stored) and after it


def test_auto_leaves_the_rows_out_where_a_block_due_now_would_wait_for_them():
    sessions = {"a": Waiting(0.030), "b": Waiting(0.030), "due": Waiting(0.0, lacks=False)}
    verifier, work = idle(sessions)
    assert verifier.taken == [] and work.prefills == 0
    assert all(s.filled == 1 for s in sessions.values())  # the fills need no forward


@pytest.mark.parametrize("mode, taken", [("always", [3]), ("off", [])])
def test_always_takes_every_row_in_and_off_none(mode, taken):
    sessions = {"a": Waiting(0.030), "b": Waiting(0.030), "due": Waiting(0.0)}
    verifier, _ = idle(sessions, mode)
    assert verifier.taken == taken


def test_a_prompt_owed_is_taken_in_even_where_nothing_else_pays():
    sessions = {"new": Waiting(0.0, prompt=True), "a": Waiting(0.0, gain=0.001), "paused": Waiting(None, lacks=False)}
    verifier, _ = idle(sessions)
    assert verifier.taken == [1]
