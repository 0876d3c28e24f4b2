"""`--threshold auto`: the offline SVIP replay and the threshold choice, on hand-built
trajectories; and, on real models, that auto changes only block lengths, never the output."""

from __future__ import annotations

import math

import pytest

from coordinator.calibration import Calibration, CostModel, Trajectory, choose_threshold, replay_svip
from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig

# entropy cut at threshold 0.3, scale 0.15: 0.6 nats
TRAJ = Trajectory(
    entropies=[0.1, 0.2, 0.9, 0.1, 0.1, 0.1, 0.1, 0.8],
    matches=[True, True, True, True, False, True, True, True],
)


def test_replay_follows_svip_blocks():
    # block 1: positions 0,1,2 (stops on H=0.9 at 2), all match -> 3 accepted + bonus at 3
    # block 2: from 4: 4 (mismatch), 5, 6, 7 (stop at H=0.8) -> 0 accepted + correction at 4
    # block 3: from 5: 5, 6, 7 (stop) -> 3 accepted, bonus would be position 8 (end)
    cost, emitted = replay_svip(TRAJ, threshold=0.3, scale=0.15, cap=40, cost=CostModel(0.1))
    assert emitted == 4 + 1 + 4
    assert cost == pytest.approx(3 * 1.0 + 0.1 * (3 + 4 + 3))
    slow_verify, _ = replay_svip(TRAJ, threshold=0.3, scale=0.15, cap=40, cost=CostModel(0.1, verify_slope=0.2))
    assert slow_verify == pytest.approx(3 * 1.0 + 0.3 * (3 + 4 + 3))


def test_replay_uses_the_policys_rule_with_its_clamp():
    """Calibration replays SVIP with the policy's own check: an entropy rounded below zero is 0
    (the bare formula raised a math domain error on it), and the boundary is strict as the policy's."""
    traj = Trajectory(entropies=[-1e-9, 0.6, 0.0], matches=[True, True, True])
    _, emitted = replay_svip(traj, threshold=0.3, scale=0.15, cap=40, cost=CostModel(0.0))
    assert emitted == 3 + 1  # sqrt(0.15 * 0.6) = 0.3 is not over 0.3: one block of all three


def test_replay_respects_the_cap():
    traj = Trajectory(entropies=[0.0] * 10, matches=[True] * 10)
    cost, emitted = replay_svip(traj, threshold=0.3, scale=0.15, cap=4, cost=CostModel(0.0))
    assert cost == 2 and emitted == 10  # 4 + bonus, 4 + bonus


def test_cheap_draft_drafts_longer_than_expensive_draft():
    trajs = [TRAJ, Trajectory(entropies=[0.3, 0.5, 0.7, 1.1, 1.5] * 4, matches=[True, True, True, False, True] * 4)]
    cheap, _ = choose_threshold(trajs, scale=0.15, cap=40, cost=CostModel(0.01))
    dear, _ = choose_threshold(trajs, scale=0.15, cap=40, cost=CostModel(0.9))
    assert cheap > dear
    costly_verify, _ = choose_threshold(trajs, scale=0.15, cap=40, cost=CostModel(0.01, verify_slope=0.5))
    assert costly_verify < cheap


def test_threshold_is_carried_across_entropy_scales():
    cal = Calibration(threshold=0.3, entropy_scale=0.15, cost_ratio=0.1, tokens=10)
    assert cal.entropy_cut == pytest.approx(0.6)
    assert cal.threshold_for(0.6) == pytest.approx(math.sqrt(0.36))


def test_auto_threshold_keeps_greedy_output_exact(models, prompt_ids):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    alone = SpeculativeEngine(models["target"], None)
    request = GenerationRequest(prompt_ids["medium"], 32, policy=PolicyConfig(name="svip", threshold="auto"))
    resolved = engine.resolve(request)
    assert isinstance(resolved.policy.threshold, float)
    assert resolved.policy.threshold == pytest.approx(engine.calibration().threshold)
    assert engine.generate(request).token_ids == alone.generate(request).token_ids
