"""The rejection sampler on hand-built distributions: the output follows p exactly.

As in vLLM's rejection-sampler test, the empirical distribution's distance to p must shrink with
the number of draws, much faster than its distance to unrelated reference distributions; and a
deliberately wrong sampler (corrections drawn from p instead of max(0, p - q)) must fail the same
check, so the check has power.
"""

from __future__ import annotations

import pytest
import torch

from svip_common.contracts import SamplingParams
from svip_common.rejection import accept_greedy, accept_sampled, recover, residual
from svip_common.sampling import sample_index, sample_indices, warp_probs

VOCAB = 8


def speculative_draw(p: torch.Tensor, q: torch.Tensor, u: tuple[float, float, float]) -> int:
    """One position, k = 1, with the verifier's scalar functions: draft d ~ q, accept w.p.
    min(1, p/q), else correct from the residual."""
    d = sample_index(q, u[0])
    if accept_sampled([float(p[d])], [float(q[d])], [u[1]]) == 1:
        return d
    return recover(p, q, u[2])


def speculative_draws(p: torch.Tensor, q: torch.Tensor, u: torch.Tensor, wrong: bool = False) -> list[int]:
    """speculative_draw at n positions at once (u: [n, 3] uniforms): the draws and the corrections
    as rows through sample_indices (what sample_index and recover run on one row), the accept rule
    per position. wrong: the classic bug, corrections drawn from p instead of max(0, p - q)."""
    n = len(u)
    drafts = sample_indices(q.expand(n, -1), u[:, 0]).tolist()
    corrections = sample_indices((p if wrong else residual(p, q)).expand(n, -1), u[:, 2]).tolist()
    ps, qs, accepts = p.tolist(), q.tolist(), u[:, 1].tolist()
    return [d if accept_sampled([ps[d]], [qs[d]], [a]) == 1 else c for d, c, a in zip(drafts, corrections, accepts)]


def uniforms(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def empirical(p, q, n: int, seed: int, wrong: bool = False) -> torch.Tensor:
    draws = torch.tensor(speculative_draws(p, q, uniforms(n, seed), wrong))
    return torch.bincount(draws, minlength=VOCAB).double() / n


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def _dist(*values: float) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


P = _dist(0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02)
CASES = {
    "q_equals_p": (P, P.clone()),
    "random": (P, _dist(0.02, 0.05, 0.10, 0.30, 0.20, 0.13, 0.10, 0.10)),
    "disjoint_supports": (_dist(0.5, 0.3, 0.2, 0, 0, 0, 0, 0), _dist(0, 0, 0, 0, 0.4, 0.3, 0.2, 0.1)),
    "q_point_mass": (P, _dist(0, 0, 0, 0, 0, 0, 0, 1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_empirical_distribution_converges_to_p(case):
    p, q = CASES[case]
    references = [q, torch.full((VOCAB,), 1.0 / VOCAB), _dist(*range(1, VOCAB + 1))]
    references = [r for r in references if tv(r, p) > 0.1]
    small = empirical(p, q, 500, seed=1)
    large = empirical(p, q, 20000, seed=2)
    # sampling noise alone: E[TV] ~ sqrt(VOCAB / n) / 2.5 -> ~0.008 at n = 20000
    assert tv(large, p) < 0.02
    assert tv(large, p) < tv(small, p) or tv(small, p) < 0.02
    for ref in references:
        assert tv(large, ref) > 5 * tv(large, p)


@pytest.mark.parametrize("case", list(CASES))
def test_the_batched_draws_are_the_scalar_functions_draws(case):
    """The statistical tests draw n positions at once; each is what the verifier's scalar
    functions (sample_index, accept_sampled, recover) give for the same uniforms."""
    p, q = CASES[case]
    u = uniforms(300, seed=5)
    assert speculative_draws(p, q, u) == [speculative_draw(p, q, tuple(row)) for row in u.tolist()]


def test_wrong_correction_rule_is_caught():
    p, q = CASES["random"]
    wrong = empirical(p, q, 20000, seed=3, wrong=True)
    assert tv(wrong, p) > 0.05


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.7, top_k=3, seed=0),
        SamplingParams(temperature=1.3, top_p=0.8, seed=0),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=0),
    ],
)
def test_warping_applied_to_both_sides(sampling):
    """p and q both come through the same temperature / top-k / top-p transform; the output
    follows the warped p, and never leaves its support."""
    gen = torch.Generator().manual_seed(7)
    target_logits = torch.randn(1, VOCAB, generator=gen) * 2
    draft_logits = target_logits + torch.randn(1, VOCAB, generator=gen)
    p = warp_probs(target_logits, sampling)[0]
    q = warp_probs(draft_logits, sampling)[0]
    out = empirical(p, q, 20000, seed=4)
    assert tv(out, p) < 0.02
    assert float(out[p == 0].sum()) == 0.0


def test_residual_is_positive_part_and_falls_back_to_p():
    p, q = _dist(0.5, 0.3, 0.2), _dist(0.2, 0.5, 0.3)
    assert torch.allclose(residual(p, q), torch.tensor([0.3, 0.0, 0.0]), atol=1e-6)
    assert torch.equal(residual(p, p), p)


def test_accept_rules():
    assert accept_greedy([4, 5, 6, 7], [4, 5, 9]) == 2
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == 3
    assert accept_greedy([4], []) == 0
    # accept iff u * q < p
    assert accept_sampled([0.5, 0.1], [0.4, 0.5], [0.99, 0.19]) == 2
    assert accept_sampled([0.5, 0.1], [0.4, 0.5], [0.99, 0.21]) == 1
    assert accept_sampled([0.0], [0.3], [0.0]) == 0  # p(d) = 0 is always rejected
