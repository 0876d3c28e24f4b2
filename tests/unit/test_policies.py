"""Each length policy stops exactly where its rule says, on hand-built logits."""

from __future__ import annotations

import math

import pytest
import torch

from draft_worker.policies import make_policy
from svip_common.contracts import PolicyConfig, SamplingParams, StepState
from svip_common.errors import InvalidRequest
from svip_common.sampling import entropy, warp_probs


def _steps(logit_rows: list[list[float]], sampling=SamplingParams()) -> list[StepState]:
    probs = warp_probs(torch.tensor(logit_rows), sampling)  # [n, vocab]
    tokens = torch.argmax(probs, dim=-1)
    return [
        StepState(index=i + 1, position=10 + i, token_id=int(t), prob=float(p[t]), entropy=float(entropy(p)))
        for i, (p, t) in enumerate(zip(probs, tokens))
    ]


def _drafted_length(policy, steps: list[StepState]) -> int:
    """What the drafter does: keep the token, then ask; the triggering token is still sent."""
    for step in steps:
        if step.index >= policy.max_length() or policy.should_stop(step):
            return step.index
    return len(steps)


def _row_with_entropy(h: float, vocab: int = 16) -> list[float]:
    """Logits [vocab] of a 'one likely token, rest uniform' row whose entropy is h nats."""
    lo, hi = -30.0, 30.0
    for _ in range(200):  # bisection on the gap between the top logit and the rest
        mid = (lo + hi) / 2
        row = [mid] + [0.0] * (vocab - 1)
        if float(entropy(torch.softmax(torch.tensor(row), -1))) > h:
            lo = mid
        else:
            hi = mid
    return [hi] + [0.0] * (vocab - 1)


def test_svip_stops_on_the_first_token_over_threshold():
    # threshold 0.3, scale 0.15: stop once H > 0.3**2 / 0.15 = 0.6 nats
    entropies = [0.1, 0.5, 0.59, 0.65, 0.2]
    steps = _steps([_row_with_entropy(h) for h in entropies])
    assert [round(s.entropy, 3) for s in steps] == pytest.approx(entropies, abs=1e-3)
    policy = make_policy(PolicyConfig(name="svip"))
    assert [policy.should_stop(s) for s in steps] == [False, False, False, True, False]
    assert _drafted_length(policy, steps) == 4  # the token at H = 0.65 is sent, then it stops


def test_svip_boundary_is_strict():
    policy = make_policy(PolicyConfig(name="svip", threshold=0.3, entropy_scale=0.15))
    h_edge = 0.3**2 / 0.15
    assert not policy.should_stop(StepState(1, 10, 0, 0.5, h_edge - 1e-9))
    assert policy.should_stop(StepState(1, 10, 0, 0.5, h_edge + 1e-9))
    assert math.isclose(math.sqrt(0.15 * h_edge), 0.3)


def test_svip_threshold_and_scale_are_per_request():
    steps = _steps([_row_with_entropy(h) for h in (1.0, 1.5, 2.5)])
    loose = make_policy(PolicyConfig(name="svip", threshold=0.5))  # stop once H > 1.667
    assert _drafted_length(loose, steps) == 3
    scaled = make_policy(PolicyConfig(name="svip", threshold=0.5, entropy_scale=0.3))  # H > 0.833
    assert _drafted_length(scaled, steps) == 1


def test_svip_cap():
    steps = _steps([_row_with_entropy(0.01)] * 50)
    assert _drafted_length(make_policy(PolicyConfig(name="svip")), steps) == 40
    assert _drafted_length(make_policy(PolicyConfig(name="svip", max_draft_length=7)), steps) == 7


def test_svip_reads_the_sampled_distribution_when_sampling():
    row = [3.0, 2.0, 1.0, 0.0]
    greedy = _steps([row])[0]
    hot = _steps([row], SamplingParams(temperature=2.0, seed=1))[0]
    assert hot.entropy > greedy.entropy
    assert greedy.entropy == pytest.approx(float(entropy(torch.softmax(torch.tensor(row), -1))))


def test_constant_policy():
    steps = _steps([_row_with_entropy(3.0)] * 10)
    assert _drafted_length(make_policy(PolicyConfig(name="constant", draft_length=6)), steps) == 6


def test_heuristic_schedule_matches_hugging_face():
    policy = make_policy(PolicyConfig(name="heuristic", draft_length=5))
    lengths = []
    for accepted_all in (True, True, False, False, False, False, False, False, True):
        k = policy.max_length()
        lengths.append(k)
        policy.update(k, k if accepted_all else 0)
    assert lengths == [5, 7, 9, 8, 7, 6, 5, 4, 3]
    for _ in range(10):
        policy.update(policy.max_length(), 0)
    assert policy.max_length() == 1  # floor


def test_heuristic_is_bounded_by_the_cap():
    policy = make_policy(PolicyConfig(name="heuristic", draft_length=38, max_draft_length=40))
    policy.update(38, 38)
    policy.update(40, 40)
    assert policy.max_length() == 40


def test_confidence_policy_stops_below_c():
    rows = [[5.0, 0.0, 0.0], [0.5, 0.4, 0.0], [5.0, 0.0, 0.0]]
    steps = _steps(rows)
    assert steps[1].prob < 0.4 < steps[0].prob
    assert _drafted_length(make_policy(PolicyConfig(name="confidence", confidence=0.4)), steps) == 2


def test_none_policy_never_drafts():
    assert make_policy(PolicyConfig(name="none")).max_length() == 0


@pytest.mark.parametrize(
    "config, message",
    [
        (PolicyConfig(name="bogus"), "unknown policy 'bogus'"),
        (PolicyConfig(threshold=-0.1), "threshold must be"),
        (PolicyConfig(draft_length=0), r"draft length must be in \[1, 64\], got 0"),
        (PolicyConfig(draft_length=65), r"draft length must be in \[1, 64\], got 65"),
        (PolicyConfig(max_draft_length=2**31), r"max draft length must be in \[1, 64\]"),
        (PolicyConfig(max_draft_length=0), "max draft length"),
        (PolicyConfig(confidence=1.5), "confidence must be"),
    ],
)
def test_bad_policy_configs_are_named(config, message):
    with pytest.raises(InvalidRequest, match=message):
        make_policy(config)
