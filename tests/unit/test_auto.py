"""The `auto` policy's model (svip_common/acceptance.py): the live fit converges on a scripted pair
whose acceptance depends on a known signal, its predictions are calibrated, the stop rule stops
where one more token no longer pays, and bad settings are one-line errors."""

from __future__ import annotations

import json
import math
import random

import pytest

from coordinator.session.wire_checks import MAX_TIMING_S
from draft_worker.policies import AutoPolicy, make_policy
from svip_common.acceptance import (
    FEATURES,
    REFIT_EVERY,
    AcceptanceModel,
    AutoEstimate,
    SessionStop,
    StopRule,
    features,
)
from svip_common.auto_prior import PRIOR_FILE, estimate_from, stored_prior
from svip_common.auto_settings import MAX_AUTO_COST, AutoSettings
from svip_common.contracts import PolicyConfig, StepState
from svip_common.errors import InvalidRequest
from svip_common.step_cost import TargetLoad

TRUE = (-3.0, 0.0, 0.0, 6.0, 0.0)  # the scripted pair: acceptance = sigmoid(6 q - 3), q the draft's q(token)


def _truth(prob: float) -> float:
    return 1 / (1 + math.exp(-(TRUE[0] + TRUE[3] * prob)))


def _scripted_blocks(n: int, seed: int = 0):
    """Blocks of 6 tokens; each token is accepted with the scripted probability, the block's verdict
    the first rejection."""
    rng = random.Random(seed)
    for _ in range(n):
        probs = [rng.random() for _ in range(6)]
        entropies = [rng.uniform(0.0, 4.0) for _ in range(6)]  # carries nothing: the fit must learn that
        accepted = 0
        while accepted < 6 and rng.random() < _truth(probs[accepted]):
            accepted += 1
        yield entropies, probs, accepted


def test_the_fit_converges_on_the_scripted_signal():
    model = AcceptanceModel()  # the generic prior: acceptance ~ q, not the truth
    for entropies, probs, accepted in _scripted_blocks(3000):
        model.observe(entropies, probs, accepted)
    assert model.fits >= 10
    rule = model.rule(0.0)
    for q in (0.1, 0.3, 0.5, 0.7, 0.9):
        assert rule.accept_prob(2.0, q, 3) == pytest.approx(_truth(q), abs=0.05), q
    state = model.to_dict()
    assert state["predicted_acceptance"] == pytest.approx(state["observed_acceptance"], abs=0.03)


def test_a_frozen_model_keeps_its_prior_but_still_scores_it():
    model = AcceptanceModel(settings=AutoSettings(learn=False))
    for entropies, probs, accepted in _scripted_blocks(500):
        model.observe(entropies, probs, accepted)
    assert model.fits == 0 and model.observed > REFIT_EVERY
    assert model.weights == AcceptanceModel().weights


def test_only_tokens_with_a_verdict_are_observed():
    model = AcceptanceModel()
    model.observe([1.0] * 5, [0.5] * 5, accepted=2)  # 2 accepted, the 3rd rejected, 2 unseen
    assert model.observed == 3 and model.accepted_sum == 2
    model.observe([1.0] * 4, [0.5] * 4, accepted=4)  # all accepted
    assert model.observed == 7 and model.accepted_sum == 6


def _block_length(policy, probs: list[float], entropy: float = 1.0) -> int:
    for i, q in enumerate(probs):
        if policy.should_stop(StepState(i + 1, 100 + i, 7, q, entropy)):
            return i + 1
    return len(probs)


def test_the_rule_stops_where_one_more_token_stops_paying():
    # a constant acceptance of 0.8 per token: the j-th token survives with 0.8^j, so at stop_at
    # 0.3 the block holds tokens while 0.8^(j+1) >= 0.3: j + 1 <= 5, and stops after the 5th
    constant = StopRule((math.log(0.8 / 0.2), 0.0, 0.0, 0.0, 0.0), stop_at=0.3)
    policy = AutoPolicy(cap=40, rule=constant)
    assert _block_length(policy, [0.5] * 20) == 5
    assert _block_length(policy, [0.5] * 20) == 5  # a new block starts from survival 1
    policy.tune(StopRule(constant.weights, stop_at=0.0))
    assert _block_length(policy, [0.5] * 20) == 20  # nothing stops it but the cap
    policy.tune(StopRule(constant.weights, stop_at=1.0))
    assert _block_length(policy, [0.5] * 20) == 1  # the first token is always sent


def test_the_rule_follows_the_signal():
    rule = StopRule(TRUE, stop_at=0.3)
    policy = AutoPolicy(cap=40, rule=rule)
    # confident tokens, then one it doubts: that one is still sent (as SVIP sends its stop token)
    assert _block_length(policy, [0.99] * 10 + [0.05] * 10) == 11
    assert _block_length(policy, [0.2] * 10) == 1


def test_the_rule_scales_the_measured_tau_by_the_pairs_rate_and_frozen_sessions_stay_put():
    estimate = AutoEstimate(prior_cost=0.25)
    greedy, sampled = SessionStop(estimate, True), SessionStop(estimate, False)
    assert greedy.rule(None).stop_at == pytest.approx(0.25)  # the prior, at rate 1 before any round
    load = TargetLoad(plain_rate=100.0, verify_token_s=0.0005, batch=1.0)  # 100 tokens/s alone
    for i in range(100):  # 3 to 5 drafted, 2 ms each after 1 ms a block: tau = 100 * (0.0005 + 0.002) = 0.25
        greedy.rule(load)
        k = 3 + i % 3
        greedy.record([0.5] * k, [0.9] * k, accepted=k, draft_s=0.001 + 0.002 * k)
    assert estimate.draft_token_s == pytest.approx(0.002) and estimate.drafting.fixed == pytest.approx(0.001)
    assert estimate.cost(load) == pytest.approx(0.25)
    assert estimate.rate.value == pytest.approx(5 / 2, rel=0.02)  # k + 1 tokens for 1 + k * 0.25, k = 4 on average
    assert greedy.rule(load).stop_at == pytest.approx(0.25 * 2.5, rel=0.02)
    assert SessionStop(estimate, True).rule(load).stop_at == pytest.approx(0.25 * 2.5, rel=0.02)  # a new session too
    first = sampled.rule(load)  # a measured cost does not move a frozen rule
    for _ in range(100):
        sampled.record([0.5] * 4, [0.9] * 4, accepted=1, draft_s=0.1)
    assert sampled.rule(TargetLoad(10.0, 0.01)) == first
    assert first.stop_at == pytest.approx(0.25 * 1.5)


def test_an_overlapped_block_costs_its_round_the_targets_step_alone():
    """Across the workers a follow-up or a prepared continuation is drafted while the target
    verifies the block before it: its acceptance is learnt as any block's, but the rate counts
    no drafted token and no round trip against its round, and its drafting time (a share of
    steps other rows rode) stays out of the fit of what a drafted token costs."""
    estimate = AutoEstimate(prior_cost=0.25)
    stop = SessionStop(estimate, True)
    load = TargetLoad(plain_rate=100.0, verify_token_s=0.0005, batch=1.0)
    for i in range(100):  # blocks the target waits for: 2 ms a token after 1 ms, tau 0.25 as above
        stop.rule(load)
        k = 3 + i % 3
        stop.record([0.5] * k, [0.9] * k, accepted=k, draft_s=0.001 + 0.002 * k, round_tokens=0.5)
    fit, waited_rate = (estimate.draft_token_s, estimate.drafting.fixed), estimate.rate.value
    assert waited_rate == pytest.approx(5 / 2.5, rel=0.02)  # k + 1 tokens for 1 + k * 0.25 + 0.5
    observed = estimate.model(True).observed
    for _ in range(100):  # overlapped ones: 4 tokens drafted in a sixteenth of 4 steps
        stop.record([0.5] * 4, [0.9] * 4, accepted=4, draft_s=0.0005, round_tokens=0.5, overlapped=True)
    assert (estimate.draft_token_s, estimate.drafting.fixed) == fit  # their drafting left out of the fit
    assert estimate.model(True).observed == observed + 400  # their acceptance learnt
    assert estimate.rate.value == pytest.approx(5.0, rel=0.02)  # 4 + 1 tokens for the step alone
    assert stop.rule(load).stop_at == pytest.approx(0.25 * 5.0, rel=0.02)  # the critical block's stop, stricter


@pytest.mark.parametrize("settings, message", [
    (AutoSettings(cost=0.0), "auto cost must be a number in \\(0, 10"),
    (AutoSettings(cost=-1.0), "auto cost must be"),
    (AutoSettings(cost=float("nan")), "auto cost must be"),
    (AutoSettings(cost=1e9), "auto cost must be"),
    (AutoSettings(window=1), "auto window must be in \\[64, "),
    (AutoSettings(window=1 << 40), "auto window must be"),
])
def test_bad_auto_settings_are_one_line_errors(settings, message):
    with pytest.raises(InvalidRequest, match=message) as err:
        settings.check()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("rule, message", [
    (StopRule((1.0, 2.0), 0.3), "needs 5 finite weights"),
    (StopRule((float("inf"),) * 5, 0.3), "needs 5 finite weights"),
    (StopRule((0.0,) * 5, -0.1), "stop_at must be in"),
    (StopRule((0.0,) * 5, float("nan")), "stop_at must be in"),
])
def test_bad_rules_are_refused(rule, message):
    with pytest.raises(InvalidRequest, match=message):
        AutoPolicy(cap=8).tune(rule)


def test_auto_is_a_policy_by_name():
    assert isinstance(make_policy(PolicyConfig(name="auto", max_draft_length=12)), AutoPolicy)
    assert len(features(1.0, 0.5, 3)) == len(FEATURES)


def test_a_stored_prior_is_read_and_a_bad_one_ignored(tmp_path):
    assert stored_prior(str(tmp_path)) is None
    (tmp_path / PRIOR_FILE).write_text(json.dumps({"weights": [0.1, 0.2, 0.3, 0.4, 0.5], "cost": 0.3}))
    prior = stored_prior(str(tmp_path))
    assert estimate_from(prior).model(True).weights == (0.1, 0.2, 0.3, 0.4, 0.5)
    for bad in ({"weights": [1.0], "cost": 0.3}, {"weights": [0.0] * 5, "cost": -1}, {"cost": 0.3}, "[]"):
        (tmp_path / PRIOR_FILE).write_text(json.dumps(bad) if not isinstance(bad, str) else bad)
        assert stored_prior(str(tmp_path)) is None, bad


@pytest.mark.parametrize("args, message", [
    ({"auto_cost": 0}, r"auto_cost must be a number in \(0, 10\]"),
    ({"auto_cost": 1e300}, "auto_cost must be a number"),
    ({"auto_cost": "cheap"}, "auto_cost must be a number"),
    ({"auto_window": 10**12}, "auto_window must be an integer in"),
    ({"auto_window": 2.5}, "auto_window must be an integer"),
    ({"auto_learn": "no"}, "auto_learn must be true or false"),
])
def test_serve_refuses_bad_auto_settings(args, message):
    from svip_serve.settings import ServeSettings

    with pytest.raises(InvalidRequest, match=message):
        ServeSettings.from_args({"policy": "auto", **args})
    assert ServeSettings.from_args({"policy": "auto", "auto_cost": 0.3}).auto() == AutoSettings(cost=0.3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_blocks_own_overhead_never_traps_auto_at_one_token(seed):
    """Issue 41: priced at the average time per drafted token, a block of one token carried the
    block's own overhead alone (its first forward's pending tokens, the rollback), looked dear, and
    the next block stopped at one token again: 425 of 433 blocks. A scripted pair whose tokens are
    accepted 90% of the time, 10 ms of overhead a block and 3 ms a token, a target step of 16.7 ms:
    the slope is what one more token costs (tau = 60 x 4 ms = 0.24), and the blocks grow long."""
    rng = random.Random(seed)
    estimate = AutoEstimate(prior_cost=0.9)  # a dear prior too: the measured slope must take over
    stop, policy = SessionStop(estimate, True), AutoPolicy(cap=40)
    load = TargetLoad(plain_rate=60.0, verify_token_s=0.001, batch=1.0)
    lengths = []
    for _ in range(300):
        policy.tune(stop.rule(load))
        probs, k = [], 0
        while k < 40:
            k += 1
            probs.append(rng.uniform(0.8, 1.0))
            if policy.should_stop(StepState(k, 100 + k, 5, probs[-1], 0.3)):
                break
        accepted = 0
        while accepted < k and rng.random() < 0.9:
            accepted += 1
        stop.record([0.3] * k, probs, accepted, draft_s=0.010 + 0.003 * k)
        lengths.append(k)
    assert estimate.draft_token_s == pytest.approx(0.003, rel=0.05)
    assert estimate.cost(load) == pytest.approx(60.0 * 0.004, rel=0.05)
    assert sum(lengths[-100:]) / 100 >= 4.0, lengths[-20:]


def test_the_longest_timing_a_target_takes_keeps_tau_finite_and_capped():
    """A draft's timings reach auto's fit (across the workers, a block's span on the draft's
    clock): the wire checks refuse any beyond MAX_TIMING_S, and at that bound the fit stays finite
    and tau stops at MAX_AUTO_COST (every block one token); it recovers as ordinary blocks come."""
    estimate = AutoEstimate(prior_cost=0.25)
    stop = SessionStop(estimate, True)
    load = TargetLoad(plain_rate=100.0, verify_token_s=0.0005, batch=1.0)
    for i in range(8):
        k = 1 + i % 3
        stop.record([0.5] * k, [0.9] * k, accepted=k, draft_s=MAX_TIMING_S * k / 3, round_tokens=0.5)
    assert math.isfinite(estimate.draft_token_s) and estimate.cost(load) == MAX_AUTO_COST
    for i in range(1000):  # its weight decays by 0.95 a block: 1e12 s to under a nanosecond
        k = 1 + i % 3
        stop.record([0.5] * k, [0.9] * k, accepted=k, draft_s=0.002 * k, round_tokens=0.5)
    assert estimate.cost(load) == pytest.approx(0.25, rel=0.01)
