"""When the target's step waits for blocks about to come (svip_common/arrivals.py): the hold that
maximises the step's tokens per second, read off the recent delays from a verdict to its next
block, and no hold where the blocks come too late, too rarely or too little is known."""

from __future__ import annotations

import pytest

from svip_common.arrivals import MIN_SAMPLES, BlockArrivals

MS = 1e-3


def arrivals(*delays_ms: float) -> BlockArrivals:
    seen = BlockArrivals()
    for delay in delays_ms:
        seen.observe(delay * MS)
    return seen


def test_it_never_holds_before_it_has_seen_enough_arrivals():
    few = arrivals(*[1.0] * (MIN_SAMPLES - 1))
    assert not few.known and few.hold_s([(0.0, 3.0)] * 8, 16 * MS, 10.0) == 0.0
    few.observe(1 * MS)
    assert few.known and few.hold_s([(0.0, 3.0)] * 8, 16 * MS, 10.0) == pytest.approx(1 * MS)


def test_it_holds_for_the_arrival_that_raises_the_steps_rate_most():
    """Half the delays 1 ms, half 10 ms; two sessions just had their verdicts, each block adding 3
    tokens to a 16 ms step settling 4. At 1 ms: (4 + 2·0.5·3) / 17 ms = 412 tokens/s; at 10 ms:
    (4 + 2·3) / 26 ms = 385; now: 4 / 16 ms = 250. So 1 ms."""
    seen = arrivals(*[1.0] * 8, *[10.0] * 8)
    assert seen.hold_s([(0.0, 3.0), (0.0, 3.0)], 16 * MS, 4.0) == pytest.approx(1 * MS)


def test_what_a_session_has_waited_already_conditions_its_arrival():
    """Waited 2 ms of the same delays: its block comes at 10 ms or not at all within the step, 8 ms
    from now: (4 + 3) / 24 ms = 292 > 250 holds; with a block adding one token, (4 + 1) / 24 ms =
    208 does not."""
    seen = arrivals(*[1.0] * 8, *[10.0] * 8)
    assert seen.hold_s([(2 * MS, 3.0)], 16 * MS, 4.0) == pytest.approx(8 * MS)
    assert seen.hold_s([(2 * MS, 1.0)], 16 * MS, 4.0) == 0.0


def test_blocks_that_come_after_the_forward_or_past_every_delay_seen_are_not_waited_for():
    late = arrivals(*[20.0] * 16)
    assert late.hold_s([(0.0, 100.0)], 16 * MS, 4.0) == 0.0  # later than the forward it would hold
    seen = arrivals(*[1.0] * 16)
    assert seen.hold_s([(5 * MS, 100.0)], 16 * MS, 4.0) == 0.0  # waited past every delay seen


def test_a_hold_never_exceeds_what_is_left_of_its_forward():
    seen = arrivals(*[1.0] * 8, *[10.0] * 8)
    assert seen.hold_s([(2 * MS, 3.0)], 16 * MS, 4.0, most_s=5 * MS) == 0.0
    assert seen.hold_s([(0.0, 3.0)] * 2, 16 * MS, 4.0, most_s=0.5 * MS) == 0.0
    assert seen.hold_s([], 16 * MS, 4.0) == 0.0


def test_a_slow_draft_against_a_short_forward_is_never_waited_for():
    """70B / 8B's numbers (docs/benchmarks.md): a fresh block 13 ms after its verdict, a 16.8 ms
    forward settling 9 tokens, four sessions waiting with 1.4 tokens each to add: (9 + 5.6) /
    29.8 ms = 490 tokens/s against 9 / 16.8 ms = 536. It starts now."""
    seen = arrivals(*[13.0] * 16)
    assert seen.hold_s([(0.0, 1.4)] * 4, 16.8 * MS, 9.0) == 0.0
