"""The shared logits -> distribution transform, entropy, the inverse-CDF draw and the seeded
per-position randomness."""

from __future__ import annotations

import math

import pytest
import torch

from svip_common import sampling
from svip_common.contracts import SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.randomness import Purpose, sample_seed, uniform
from svip_common.sampling import entropy, sample_index, warp_probs

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def test_greedy_is_softmax_of_raw_logits():
    assert torch.allclose(warp_probs(LOGITS, SamplingParams()), torch.softmax(LOGITS, -1))


def test_temperature():
    out = warp_probs(LOGITS, SamplingParams(temperature=0.5))
    assert torch.allclose(out, torch.softmax(LOGITS / 0.5, -1))


def test_top_k_keeps_k_most_likely():
    out = warp_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))[0]
    assert (out > 0).tolist() == [True, True, False, False, False]
    assert math.isclose(float(out.sum()), 1.0, rel_tol=1e-6)


def test_top_p_keeps_smallest_set_reaching_p():
    base = torch.softmax(LOGITS, -1)[0]  # ~[0.55, 0.20, 0.12, 0.07, 0.03]
    out = warp_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.6))[0]
    assert (out > 0).tolist() == [True, True, False, False, False]
    assert float(base[0]) < 0.6 < float(base[:2].sum())
    only_top = warp_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.1))[0]
    assert (only_top > 0).tolist() == [True, False, False, False, False]


def test_entropy_in_nats():
    assert math.isclose(float(entropy(torch.full((4,), 0.25))), math.log(4), rel_tol=1e-6)
    assert float(entropy(torch.tensor([1.0, 0.0, 0.0]))) == pytest.approx(0.0, abs=1e-6)


def test_sample_index_inverse_cdf():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75])
    assert sample_index(probs, 0.0) == 1
    assert sample_index(probs, 0.2499) == 1
    assert sample_index(probs, 0.25) == 3
    assert sample_index(probs, 0.999999) == 3
    assert sample_index(torch.tensor([2.0, 2.0]), 0.6) == 1  # unnormalised is fine


def test_uniform_is_keyed_and_uniform():
    a = uniform(7, 10, Purpose.ACCEPT)
    assert a == uniform(7, 10, Purpose.ACCEPT)
    assert len({a, uniform(8, 10, Purpose.ACCEPT), uniform(7, 11, Purpose.ACCEPT), uniform(7, 10, Purpose.DRAFT)}) == 4
    draws = torch.tensor([uniform(3, i, Purpose.RESOLVE) for i in range(20000)], dtype=torch.float64)
    assert 0.0 <= float(draws.min()) and float(draws.max()) < 1.0
    assert abs(float(draws.mean()) - 0.5) < 0.01
    hist = torch.histc(draws, bins=10, min=0, max=1)
    assert float(hist.min()) > 1800 and float(hist.max()) < 2200


def test_sample_seeds():
    assert sample_seed(5, 0) == 5 and sample_seed(5, 3) == 8


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(temperature=-1.0), "temperature must be"),
        (SamplingParams(temperature=float("nan")), "temperature must be"),
        (SamplingParams(top_p=0.0), "top_p must be in"),
        (SamplingParams(top_p=1.5), "top_p must be in"),
        (SamplingParams(top_k=-2), "top_k must be"),
        (SamplingParams(seed=-1), "seed must be"),
    ],
)
def test_bad_sampling_params_are_named(params, message):
    with pytest.raises(InvalidRequest, match=message):
        params.validate()


def test_sample_indices_draws_each_row_as_the_inverse_cdf_does():
    """Rows with stretches of zeros (top-k / top-p), unnormalised rows, u at the edges: the batched
    draw equals the definition (the first id whose cumulative mass passes u * total, stepped back
    over zeros) row by row."""
    from svip_common.sampling import sample_indices

    g = torch.Generator().manual_seed(0)
    probs = torch.rand(64, 50, generator=g) * (torch.rand(64, 50, generator=g) > 0.6)
    probs[0] = 0.0
    probs[0, 7] = 1.0  # one id with mass
    probs[1, :] = 0.0
    probs[1, -1] = 3.0  # the last id only, unnormalised
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[2], u[3] = 0.0, 1.0 - 1e-12
    probs[4, -5:] = 0.0
    u[4] = 1.0  # past every id's cumulative mass (as u * total rounded up to the total would be): the last with mass
    drawn = sample_indices(probs, u).tolist()
    for row, x, d in zip(probs, u.tolist(), drawn):
        cdf = row.double().cumsum(0).tolist()
        expect = next((i for i, c in enumerate(cdf) if c > x * cdf[-1]), len(cdf) - 1)
        while row[expect] <= 0 and expect > 0:
            expect -= 1
        assert d == expect and row[d] > 0


def _nucleus_by_full_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition, one row at a time in float64: the most likely ids, in order, until the mass
    before the next reaches top_p."""
    keep = torch.zeros_like(logits, dtype=torch.bool)
    for i, row in enumerate(logits.double()):
        values, order = torch.sort(row, descending=True)
        probs = torch.softmax(values, dim=-1)
        keep[i, order[(probs.cumsum(-1) - probs) < top_p]] = True
    return keep


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.97])
def test_top_p_from_the_most_likely_candidates_is_the_full_sorts_nucleus_for_every_size(top_p):
    """Rows from peaked to flat over 16384 ids, so that nuclei end inside the first 64 candidates,
    the next 512, 4096, and past them (a full sort); some after top-k. Each row's kept set is the
    definition's, and the same whether the row is warped among the others or alone."""
    g = torch.Generator().manual_seed(7)
    scales = torch.logspace(1.2, -1.5, 24)  # 16 down to 0.03
    logits = torch.randn(len(scales), 16384, generator=g) * scales[:, None]
    params = SamplingParams(temperature=1.0, top_p=top_p)
    probs = warp_probs(logits, params)
    expected = _nucleus_by_full_sort(logits, top_p)
    assert torch.equal(probs > 0, expected)
    sizes = expected.sum(-1)
    assert sizes.min() <= 64 and ((sizes > 64) & (sizes <= 512)).any() and (sizes > 4096).any(), sizes
    for i in range(len(scales)):
        assert torch.equal(warp_probs(logits[i : i + 1], params)[0], probs[i])
    with pytest.MonkeyPatch.context() as patch:  # off a CPU: one sort, no host read; the same bits
        patch.setattr(sampling, "HOST_DEVICES", ())
        assert torch.equal(warp_probs(logits, params), probs)
    after_top_k = warp_probs(logits, SamplingParams(temperature=1.0, top_k=100, top_p=top_p))
    cut = torch.full_like(logits, float("-inf"))
    top = torch.topk(logits, 100, dim=-1)
    cut.scatter_(-1, top.indices, top.values)
    assert torch.equal(after_top_k > 0, _nucleus_by_full_sort(cut, top_p))


def test_top_p_keeps_every_token_tied_with_the_least_likely_one_it_keeps():
    logits = torch.tensor([[5.0, 3.0, 3.0, 3.0, 0.0, -1.0]])
    out = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))[0]  # mass 0.8 reached at a 3.0
    assert (out > 0).tolist() == [True, True, True, True, False, False]


@pytest.mark.parametrize("top_p", [5e-324, 1e-46, 1e-45, 1e-38, 1e-12, 1e-7])
@pytest.mark.parametrize("vocab", [5, 4096])  # the whole row sorted; the candidates searched first
def test_a_top_p_below_floats_resolution_keeps_the_most_likely_token(top_p, vocab):
    """A nucleus smaller than any float32 mass is the most likely id (and its ties): never an
    empty set (review N1: 1e-46 became 0 in float32, kept nothing and gathered index -1)."""
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[1, 2] = logits[1].max() + 5.0  # one row with a clear favourite
    out = warp_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.isfinite(out).all()
    assert torch.equal(out > 0, logits == logits.max(dim=-1, keepdim=True).values)
    assert torch.allclose(out.sum(dim=-1), torch.ones(3))


@pytest.mark.parametrize("device_search", [True, False])
def test_both_top_p_searches_keep_the_top_id_at_the_smallest_top_p(monkeypatch, device_search):
    """The sort path (off a CPU) and the candidates path (on one) agree at the extreme too."""
    if device_search:
        monkeypatch.setattr(sampling, "HOST_DEVICES", ())
    logits = torch.randn(4, 600, generator=torch.Generator().manual_seed(1))
    out = warp_probs(logits, SamplingParams(temperature=0.5, top_k=40, top_p=5e-324))
    assert torch.equal(out > 0, logits == logits.max(dim=-1, keepdim=True).values)


def _greedy_reference(logits: torch.Tensor, k: int):
    """What the torch ops give: ids by q, most likely first and the lowest id first among ties,
    their q, and entropy(softmax)."""
    q = torch.softmax(logits.float(), dim=-1)
    out = []
    for row in q:
        order = sorted(range(row.shape[0]), key=lambda i: (-float(row[i]), i))[:k]
        out.append((order, [float(row[i]) for i in order], float(entropy(row[None])[0])))
    return out


@pytest.mark.parametrize("k", [1, 2, 6])
def test_greedy_top_on_host_is_the_torch_ops_reading(k):
    """Each row's k most likely ids (ties by lowest id, as argmax), their q and the entropy of q,
    as softmax, topk and entropy give them: on random rows, rows of many ties, rows with columns at
    -inf (padding, a grammar's mask) and a near-certain row whose entropy rounds below 0."""
    torch.manual_seed(0)
    rows = [torch.randn(40) * 3, torch.randint(-2, 3, (40,)).float(), torch.zeros(40), torch.randn(40)]
    rows[3][10:] = float("-inf")
    certain = torch.full((40,), -30.0)
    certain[7] = 30.0
    logits = torch.stack(rows + [certain])
    kept = logits.clone()
    got = sampling.greedy_top_on_host(logits, k)
    assert torch.equal(logits, kept)  # the caller's rows as they were
    for (ids, probs, h), (want_ids, want_probs, want_h) in zip(got, _greedy_reference(logits, k)):
        assert ids == want_ids
        assert probs == pytest.approx(want_probs, abs=1e-7)
        assert h == pytest.approx(want_h, abs=1e-5) and h >= 0.0


def test_greedy_top_on_host_leaves_columns_at_minus_inf_out_of_the_entropy():
    """A row where every column but one is at -inf: its token is that one, with q 1 and entropy 0."""
    logits = torch.full((1, 8), float("-inf"))
    logits[0, 5] = 2.0
    [(ids, probs, h)] = sampling.greedy_top_on_host(logits, 1)
    assert (ids, probs, h) == ([5], [1.0], 0.0)
