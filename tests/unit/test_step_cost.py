"""Load-aware speculation: the online cost fit and the cap it gives."""

from __future__ import annotations

import random

import pytest

from svip_common.step_cost import (
    UNLIMITED,
    AcceptanceRate,
    Ewma,
    StepCost,
    TargetLoad,
    row_share,
    speculation_cap,
    target_load,
)


def test_the_fit_recovers_fixed_and_per_item_cost_through_noise():
    rng = random.Random(0)
    cost = StepCost()
    for _ in range(400):
        items = rng.randint(1, 64)
        cost.observe(items, 0.010 + 0.0005 * items + rng.gauss(0, 0.0005))
    assert cost.fixed == pytest.approx(0.010, rel=0.1)
    assert cost.per_item == pytest.approx(0.0005, rel=0.1)


def test_until_items_vary_a_step_is_all_fixed_cost():
    cost = StepCost()
    for _ in range(20):
        cost.observe(5, 0.01)
    assert cost.per_item == 0.0 and cost.fixed == pytest.approx(0.01)


def test_the_slope_is_kept_while_items_stop_varying():
    cost = StepCost(decay=0.9)
    for items in [1, 40] * 20:
        cost.observe(items, 0.01 + 0.001 * items)
    slope = cost.per_item
    for _ in range(200):  # every session at cap 0: steps all the same size
        cost.observe(16, 0.01 + 0.001 * 16)
    assert cost.per_item == pytest.approx(slope) and slope == pytest.approx(0.001, rel=0.01)


def test_an_idle_gpu_like_target_leaves_the_cap_to_the_policy():
    """Verification free (b = 0), a drafted token at 1/20 of a target step: τ = 0.05."""
    verify = StepCost()
    for _ in range(10):
        verify.observe(5, 0.020)
    load = target_load(verify, 1)
    assert load.plain_rate == pytest.approx(50.0)
    assert speculation_cap(load, 0.001, 0.8) == 13  # ln 0.05 / ln 0.8
    assert speculation_cap(load, 0.001, 0.8, block_rate=0.6) == UNLIMITED  # the blocks pay as they are


def test_blocks_that_do_not_pay_as_they_are_are_cut_where_tokens_stop_paying():
    load = TargetLoad(plain_rate=100.0, verify_token_s=0.001)  # τ = 0.1 + 100 · d
    assert speculation_cap(load, 0.004, 0.8, block_rate=0.55) == UNLIMITED  # τ = 0.5 ≤ 0.55
    assert speculation_cap(load, 0.004, 0.8, block_rate=0.45) == 3  # ⌊ln 0.5 / ln 0.8⌋
    assert speculation_cap(load, 0.004, 0.4, block_rate=0.3) == 0  # not even the first token


def test_the_fit_is_not_trusted_before_a_few_steps():
    verify = StepCost()
    for _ in range(3):
        assert target_load(verify, 1) is None
        verify.observe(5, 0.02)
    verify.observe(5, 0.02)
    assert target_load(verify, 1) is not None


def test_a_compute_bound_target_stops_speculation():
    """At 64 sessions a step costs mostly per token: one more verified token costs nearly what
    the target alone makes in that time."""
    load = TargetLoad(plain_rate=64 / (0.005 + 64 * 0.002), verify_token_s=0.002)
    assert speculation_cap(load, 0.0001, 0.9) == 0


def test_the_cap_shrinks_as_the_batch_grows():
    verify = StepCost()
    for items in range(1, 200):
        verify.observe(items, 0.008 + 0.0002 * items)
    caps = [speculation_cap(target_load(verify, b), 0.0005, 0.85) for b in (1, 4, 16, 64, 256)]
    assert caps == sorted(caps, reverse=True) and caps[0] > 2 and caps[-1] == 0


def test_no_measurement_means_no_cap():
    assert speculation_cap(None, 0.0, 0.5) == UNLIMITED
    assert target_load(StepCost(), 4) is None


def test_acceptance_rate_follows_the_verdicts():
    rate = AcceptanceRate()
    assert rate.value == pytest.approx(0.8)
    for _ in range(30):
        rate.update(4, 1)
    assert rate.value < 0.6
    for _ in range(60):
        rate.update(4, 4)
    assert rate.value > 0.95
    before = rate.value
    rate.update(0, 0)  # no block, no evidence
    assert rate.value == before


def test_a_paused_gate_resumes_only_when_two_tokens_pay():
    """Hysteresis: a session at the edge does not flip between drafting and not every round."""
    from svip_common.step_cost import RESUME_CAP, SessionGate

    gate = SessionGate()
    for _ in range(10):
        gate.record(4, 2)  # half the tokens accepted: α = 2/3, block rate 1/2
    heavy = TargetLoad(plain_rate=100.0, verify_token_s=0.02)  # τ = 2: nothing pays
    edge = TargetLoad(plain_rate=100.0, verify_token_s=0.006)  # τ = 0.6: one token pays at α ≈ 0.67
    light = TargetLoad(plain_rate=100.0, verify_token_s=0.001)
    assert gate.cap(light) >= RESUME_CAP and not gate.paused
    assert gate.cap(heavy) == 0 and gate.paused and gate.pauses == 1
    assert speculation_cap(edge, 0.0, gate.acceptance.value, gate.acceptance.block_rate) == 1
    assert gate.cap(edge) == 0 and gate.paused  # 1 < RESUME_CAP: still paused
    assert gate.cap(light) >= RESUME_CAP and not gate.paused
    assert gate.cap(edge) == 1 and gate.pauses == 1  # drafting: 1 is worth it


def test_a_session_paused_for_poor_acceptance_probes_then_tries_again_later():
    """A paused session drafts a probe block every 4, 8, 16, 32, 32... paused rounds (the evidence
    that paused it may be stale); without better evidence it stays paused, and resumes only once
    its acceptance has drifted back toward the prior."""
    from svip_common.step_cost import PROBE_TOKENS, SessionGate

    gate = SessionGate()
    load = TargetLoad(plain_rate=100.0, verify_token_s=0.002)  # τ = 0.2
    for _ in range(20):
        gate.record(4, 0)  # the draft is wrong every time here
    assert gate.cap(load) == 0 and gate.paused
    caps = []
    while not caps or caps[-1] in (0, PROBE_TOKENS) and gate.paused:
        caps.append(gate.cap(load))
        assert len(caps) < 500
    probes = [i + 1 for i, c in enumerate(caps) if c == PROBE_TOKENS and i + 1 < len(caps)]
    assert probes[:4] == [4, 4 + 8, 4 + 8 + 16, 4 + 8 + 16 + 32] and gate.probes == len(probes)
    assert len(caps) > 20 and not gate.paused  # not at once: only after a while without drafting


def test_a_probe_that_finds_the_draft_good_again_resumes_drafting():
    """The scripted case behind the probes: acceptance was poor, then the text turned easy. A
    probe block's verdict is the evidence that resumes the session (relaxing alone would take
    far longer)."""
    from svip_common.step_cost import PROBE_TOKENS, RESUME_CAP, SessionGate

    gate = SessionGate()
    load = TargetLoad(plain_rate=100.0, verify_token_s=0.002)
    for _ in range(20):
        gate.record(4, 0)
    assert gate.cap(load) == 0
    rounds = 0
    while (cap := gate.cap(load)) != PROBE_TOKENS:
        rounds += 1
    for _ in range(3):  # the probes are accepted whole now
        gate.record(PROBE_TOKENS, PROBE_TOKENS)
        cap = gate.cap(load)
        if not gate.paused:
            break
        while cap == 0:
            cap = gate.cap(load)
    assert not gate.paused and cap >= RESUME_CAP and rounds == 3


def test_a_non_finite_drafting_time_is_not_learnt():
    from svip_common.step_cost import SessionGate

    gate = SessionGate()
    gate.record(4, 4, 0.004)
    gate.record(4, 4, float("nan"))
    gate.record_round_trip(float("inf"))
    assert gate.draft_token_s == 0.001 and gate.round_s == 0.0


def test_a_round_trip_counts_for_one_session_and_fades_in_a_full_batch():
    """Across workers a drafting round also waits a round trip: at one session the target idles
    through it, in a batch of 16 it serves the others meanwhile."""
    alone = TargetLoad(plain_rate=200.0, verify_token_s=0.0002, batch=1.0)  # a 5 ms step
    full = TargetLoad(plain_rate=1600.0, verify_token_s=0.0001, batch=16.0)  # a 10 ms step
    assert alone.round_tokens(0.002) == pytest.approx(0.4) and full.round_tokens(0.002) == pytest.approx(0.2)
    # blocks of 2 tokens, half of them accepted, τ = 0.24: they pay in one process (1.0 ≥ 0.48) ...
    assert speculation_cap(alone, 0.001, 0.6, block_rate=0.5, round_s=0.0, drafted=2.0) == UNLIMITED
    # ... not with a 4 ms round trip at one session (1.0 < 0.48 + 0.8), nor cut to ⌊ln τ / ln α⌋
    # = 2 tokens (0.6 + 0.36 - 0.48 < 0.8): the session pauses
    assert speculation_cap(alone, 0.001, 0.6, block_rate=0.5, round_s=0.004, drafted=2.0) == 0
    # in a full batch the same round trip costs 0.4 of a token: they pay again (1.0 ≥ 0.48 + 0.4)
    assert speculation_cap(full, 0.00005, 0.6, block_rate=0.5, round_s=0.004, drafted=2.0) == UNLIMITED


def test_ewma_takes_its_first_sample_then_weights_each_new_one():
    avg = Ewma(0.25)
    assert avg.value == 0.0 and Ewma(0.25, empty=None).value is None
    assert avg.update(8.0) == 8.0  # the first sample as it is, not weighted against the empty value
    assert avg.update(4.0) == pytest.approx(0.75 * 8.0 + 0.25 * 4.0)
    assert avg.update(0.0) == pytest.approx(0.75 * 7.0) and avg.samples == 3


def test_a_drafted_row_costs_what_drafted_rows_added_over_a_plain_step():
    """A forward's time is not a line in its tokens: on a CPU the first row past one per session
    pads every session's attention (measured at batch 16: 13.4 ms plain, 15.9 ms with one drafted
    row, ~0.3 ms a row after). The line through the drafting steps prices a row at its slope; with
    the plain steps' own fit a drafted row costs what the rows added over a plain step on average,
    and a plain step is what it measured."""
    verify, plain = StepCost(), StepCost()
    for _ in range(20):
        verify.observe(16, 0.0134)
        plain.observe(16, 0.0134)
        for rows in (17, 20, 24):
            verify.observe(rows, 0.0134 + 0.0022 + 0.0003 * (rows - 16))
    line = target_load(verify, 16)
    measured = target_load(verify, 16, plain)
    assert line.verify_token_s == pytest.approx(verify.per_item) and line.verify_token_s < 0.0005
    assert measured.plain_rate == pytest.approx(16 / 0.0134)
    extra = verify.items - 16
    assert measured.verify_token_s == pytest.approx((verify.time(verify.items) - 0.0134) / extra)
    assert measured.verify_token_s > 0.0007  # the padding counted: about 0.8 ms a row here
    # speculation that the line would let through pauses: a good draft, its token at 0.1 ms
    assert speculation_cap(line, 0.0001, 0.8, block_rate=0.8) == UNLIMITED
    assert speculation_cap(measured, 0.0001, 0.8, block_rate=0.8) == 0
    for _ in range(200):  # every session paused: plain steps only; the slope is what remains
        verify.observe(16, 0.0134)
        plain.observe(16, 0.0134)
    assert target_load(verify, 16, plain).verify_token_s == pytest.approx(verify.per_item)


def test_a_new_session_starts_from_what_drafting_cost_the_sessions_before_it():
    """The engine's (or worker's) shared estimate: a fresh gate that would take drafting as free
    drafts at a load where it does not pay (and its draft takes its prompt in for nothing)."""
    from svip_common.step_cost import SessionGate

    shared = Ewma(0.2)
    load = TargetLoad(plain_rate=1200.0, verify_token_s=0.0004, batch=16)  # τ = 0.48 + 1200 · d
    first = SessionGate(shared_draft_token_s=shared)
    assert first.draft_token_s == 0.0 and first.cap(load) == UNLIMITED  # nothing known yet
    first.record(2, 1, draft_s=0.0008)  # 0.4 ms a drafted token
    assert shared.value == pytest.approx(0.0004)
    fresh, alone = SessionGate(shared_draft_token_s=shared), SessionGate()
    assert fresh.draft_token_s == pytest.approx(0.0004) and alone.draft_token_s == 0.0
    assert fresh.cap(load) == 0 and fresh.paused  # τ = 0.96: nothing pays
    assert alone.cap(load) == UNLIMITED  # τ = 0.48 against the prior's 0.8
    fresh.record(1, 1, draft_s=0.0001)
    assert fresh.draft_token_s == pytest.approx(0.0001)  # its own, once it has one


def test_in_a_batch_each_paused_session_probes_as_much_less_often():
    """A probe's block holds up every session of its step: at 16 sessions a step, each probes 16
    times less often, so the batch probes as often as one session alone."""
    from svip_common.step_cost import PROBE_FIRST, PROBE_TOKENS, SessionGate

    def first_probe(batch: float) -> int:
        gate = SessionGate()
        for _ in range(20):
            gate.record(4, 0)
        load = TargetLoad(plain_rate=100.0, verify_token_s=0.002, batch=batch)
        assert gate.cap(load) == 0
        rounds = 1
        while gate.cap(load) != PROBE_TOKENS:
            rounds += 1
        return rounds

    assert first_probe(1) == PROBE_FIRST and first_probe(16) == 16 * PROBE_FIRST


def test_the_gate_prices_one_more_drafted_token_at_the_slope_not_the_block_average():
    """A session's blocks of 1 to 4 tokens that take 20 ms a block plus 1 ms a token to draft, 4 of
    every 10 tokens accepted, at a target of 100 tokens/s and 1 ms a verified token. One more token
    costs τ = 100 · (0.001 + 0.001) = 0.2 and the blocks pay (0.4 accepted a drafted token); priced
    at the average (9 ms a token over these blocks: τ = 1.0) the blocks' own overhead falls on
    their tokens and the session pauses (it did before the gate took the slope)."""
    from svip_common.step_cost import SessionGate

    gate = SessionGate(cuts=False)
    for drafted in (1, 4, 2, 3) * 5:
        gate.record(drafted, drafted // 2, 0.020 + 0.001 * drafted)
    assert gate.marginal_draft_token_s == pytest.approx(0.001, rel=1e-6)
    assert gate.draft_token_s == pytest.approx(0.009, rel=0.2)  # a block's wait counts its overhead (prefill_pays)
    load = TargetLoad(plain_rate=100.0, verify_token_s=0.001)
    assert speculation_cap(load, gate.draft_token_s, gate.acceptance.value, gate.acceptance.block_rate) == 0
    assert gate.cap(load) == UNLIMITED and not gate.paused

    alone = SessionGate(cuts=False)  # every block one token: the slope cannot be told, the average stands
    for _ in range(20):
        alone.record(1, 0, 0.021)
    assert alone.marginal_draft_token_s == pytest.approx(alone.draft_token_s)
    assert alone.cap(load) == 0 and alone.paused


def test_a_rows_share_of_a_step_is_what_it_adds_to_a_step_of_one():
    cost = StepCost()
    assert row_share(cost) == 0.0  # nothing measured: nothing priced
    for _ in range(10):
        cost.observe(4, 0.004)
    assert row_share(cost) == 0.0  # one width only: the slope is unknown, so free
    cost = StepCost()
    for items in [1, 16] * 20:
        cost.observe(items, 0.001 + 0.0002 * items)
    assert row_share(cost) == pytest.approx(0.0002 / 0.0012)
