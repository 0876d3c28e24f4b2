"""`svip bench --mode replay` (svip_bench/replay.py): the project's policy objects replayed along
hand-built trajectories, in modelled cost, against arithmetic done by hand."""

from __future__ import annotations

import pytest

from coordinator.calibration import CostModel, Trajectory
from svip_bench.replay import over_best_fixed, replay, replay_oracle, replayed_methods, table
from svip_common.acceptance import AutoEstimate
from svip_common.auto_settings import AutoSettings
from svip_common.contracts import PolicyConfig

# five accepted, one rejected, repeated: the draft is sure where it is right, unsure where it is wrong
TRAJ = Trajectory(entropies=([0.05] * 5 + [2.5]) * 2, matches=([True] * 5 + [False]) * 2,
                  probs=([0.95] * 5 + [0.2]) * 2)
COST = CostModel(draft_ratio=0.2, verify_slope=0.05)


def test_a_constant_length_costs_and_settles_what_is_worked_out_by_hand():
    r = replay(TRAJ, PolicyConfig(name="constant", draft_length=3), COST)
    # at 0: 3 accepted, 4 settled; at 4: 4 accepted, 5 rejected (2 settled); at 6: 3 accepted (4);
    # at 10: two places left, 10 accepted and 11 rejected (2): 11 drafted in 4 rounds
    assert r.emitted == 12 and r.drafted == 11
    assert r.cost == pytest.approx(4 + 0.25 * 11)


def test_the_oracle_drafts_exactly_what_is_accepted_and_no_policy_beats_it():
    oracle = replay_oracle(TRAJ, COST)
    assert (oracle.emitted, oracle.drafted) == (12, 10)  # two rounds of 5 accepted + the correction
    assert oracle.cost == pytest.approx(2 * (1 + 0.25 * 5))
    for m in replayed_methods([1, 2, 3, 6], (0.4,), (0.5,), 0.5):
        if m.family == "oracle":
            continue
        estimate = AutoEstimate(settings=AutoSettings(cost=0.25)) if m.policy.name == "auto" else None
        r = replay(TRAJ, m.policy, COST, estimate, gated=m.load_aware != "off")
        assert r.speedup <= oracle.speedup + 1e-12, m.name


def test_confidence_stops_at_the_unsure_token_as_the_oracle_would_plus_one():
    r = replay(TRAJ, PolicyConfig(name="confidence", confidence=0.5), COST)
    assert (r.emitted, r.drafted) == (12, 12)  # each block runs to the rejected token and stops on it


def test_the_table_pools_categories_and_names_the_best_fixed_method():
    trajs = [("code", TRAJ), ("qa", TRAJ)]
    methods = replayed_methods([2, 5], (), (), 0.5)
    result = table(trajs, methods, COST, lambda: AutoEstimate(settings=AutoSettings(cost=0.25)))
    assert set(result) == {"code", "qa", "all"}
    assert result["all"]["constant-5"] == pytest.approx(result["code"]["constant-5"])
    assert {"auto", "defaults", "oracle"} <= set(result["all"])
    ratios = over_best_fixed(result)
    assert ratios["all"]["oracle"] >= 1.0
    assert ratios["all"]["best_fixed"] in {m.name for m in methods} and ratios["all"]["best_fixed"] != "auto"


def test_behind_the_gate_a_draft_that_is_never_right_pauses_and_only_probes():
    wrong = Trajectory(entropies=[0.05] * 200, matches=[False] * 200, probs=[0.95] * 200)
    estimate = AutoEstimate(settings=AutoSettings(cost=0.25))
    alone = replay(wrong, PolicyConfig(), COST, estimate)
    gated = replay(wrong, PolicyConfig(), COST, AutoEstimate(settings=AutoSettings(cost=0.25)), gated=True)
    assert alone.emitted == gated.emitted == 200
    assert alone.drafted >= 200  # without the gate auto drafts at least one token every round
    # paused but for its probes and the blocks after a pause's drift back to the prior (the gate's design)
    assert gated.drafted < alone.drafted / 4
    assert gated.cost < alone.cost
