"""Rows that ride a verification step (coordinator/session/idle_work.py, ``IdleWork.riders``):
which sessions waiting on their drafts have their next row computed beside the step's blocks, by
the target's measured cost of a row and the tokens a verified block settles; without a model (a
stand-in verifier whose step cost the test sets, sessions that say whether they want to ride)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from coordinator.session.idle_work import IdleWork
from svip_common.contracts import Block, Verdict
from svip_common.step_cost import StepCost


class Cost(StepCost):
    """A step's time as the test sets it: fixed + per_item x tokens."""

    def __init__(self, fixed: float, per_item: float):
        super().__init__()
        self._fixed, self._per = fixed, per_item

    @property
    def fixed(self) -> float:
        return self._fixed

    @property
    def per_item(self) -> float:
        return self._per


class Waiting:
    """A session waiting on its draft (or not), lacking ``uncached_tokens`` of its committed ones,
    its drafted tokens rejected a quarter of the time (``ride_value``)."""

    ride_value = 0.25

    def __init__(self, ride: bool = True, uncached: int = 1):
        self.ride, self.uncached_tokens = ride, uncached

    def wants_ride(self) -> bool:
        return self.ride

    def wants_fill(self) -> bool:
        return self.ride

    def fill(self, started: float, ended: float) -> list:
        return []


def work(cost: Cost, mode: str = "auto", feature_layers: tuple = ()) -> IdleWork:
    verifier = SimpleNamespace(decode_cost=cost, feature_layers=feature_layers)
    return IdleWork(verifier, mode, None, clock=lambda: 0.0)


def ready(n: int, tokens: int = 3) -> list:
    """n jobs of the host's step, each a block of ``tokens`` drafted tokens."""
    return [(f"r{i}", None, None, Block(base=10, tokens=[5] * tokens, probs=[], entropies=[]), (0.0, "drafted"))
            for i in range(n)]


def test_on_a_device_where_a_row_is_nearly_free_every_waiting_session_rides():
    sessions = {"r0": Waiting(), "a": Waiting(), "b": Waiting(uncached=2), "c": Waiting(ride=False)}
    riders = work(Cost(0.016, 0.00001)).riders(sessions, ready(1), {})
    assert [sid for sid, _ in riders] == ["a", "b"]  # not the one verified, nor one that waits on nothing


def test_a_row_rides_only_while_the_steps_tokens_per_second_rise():
    """A forward of F seconds settling S tokens takes a row adding a seconds and gaining v tokens
    only if a·S < v·F. Two blocks of no drafted token (S = 2: a block settles one until steps
    say more), F = 10 ms + 2 rows: a 4 ms row (8 ms·token against 0.25 x 18) does not pay; 1 ms
    rows do, each raising S by v and F by a for the next (2 < 3, 2.25 < 3.25, 2.5 < 3.5, ...)."""
    sessions = {f"w{i}": Waiting() for i in range(4)}
    assert work(Cost(0.010, 0.004)).riders(sessions, ready(2, tokens=0), {}) == []
    assert len(work(Cost(0.010, 0.001)).riders(sessions, ready(2, tokens=0), {})) == 4


def test_the_cheapest_rows_ride_first_and_a_dear_one_not_at_all():
    sessions = {"long": Waiting(uncached=6), "short": Waiting(uncached=1)}
    riders = work(Cost(0.010, 0.001)).riders(sessions, ready(4, tokens=1), {})
    assert [sid for sid, _ in riders] == ["short"]  # 4 < 4.5, then 6 ms x 4.25 tokens against 0.25 x 19 ms


@pytest.mark.parametrize("mode, layers, expected", [("off", (), 0), ("auto", (3,), 0), ("always", (), 2)])
def test_off_or_a_feature_draft_rides_nothing_and_always_rides_every_waiting_session(mode, layers, expected):
    sessions = {"a": Waiting(uncached=50), "b": Waiting(uncached=50)}
    assert len(work(Cost(0.001, 0.01), mode, layers).riders(sessions, ready(1), {})) == expected


def test_sessions_waiting_for_pages_do_not_ride():
    sessions = {"a": Waiting(), "b": Waiting()}
    assert [sid for sid, _ in work(Cost(0.016, 0.0)).riders(sessions, ready(1), {"a": 0})] == ["b"]


def test_after_the_step_the_riders_fill_and_the_tokens_a_block_settles_are_learnt():
    idle = work(Cost(0.016, 0.0))
    riders = [("a", Waiting()), ("b", Waiting())]
    filled = []

    def step(session_id, event, *args):
        filled.append(session_id)
        return []

    idle.ridden(riders, [Verdict(10, 3, 7), None, Verdict(10, 1, 7), RuntimeError("failed alone")], step, 0.0, 1.0)
    assert filled == ["a", "b"] and idle.rides == 2
    assert idle.settled.value == pytest.approx((4 + 2) / 2)  # the first step's mean, as it is
