"""Speculative sampling end to end: the marginal distribution of the first generated tokens
matches the target's own (warped) distribution, by a chi-square goodness-of-fit test.

False-positive rate: each test runs chi-square at alpha = 1e-3 on 2 positions; across the 2
sampling configurations that is at most 4e-3 (Bonferroni) for a correct implementation. The
samples are seeded, so a given build passes or fails deterministically. The same samples checked
against the draft's own distribution must be rejected, so the test has power.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_common.sampling import add_bias, warp_probs

ALPHA = 1e-3
SAMPLES = 2500
ALONE = 100  # of them also run one at a time: the same draws
CONFIGS = {
    "t1": SamplingParams(temperature=1.0),
    "warped": SamplingParams(temperature=0.8, top_k=40, top_p=0.9),
}


@torch.inference_mode()
def exact_marginals(model, prompt, sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """p(t1) and p(t2) = sum_x p(t1 = x) p(t2 | x), both [vocab], from the model alone."""
    first = add_bias(model(input_ids=torch.tensor([prompt])).logits[0, -1:], sampling.logit_bias)
    seen = torch.zeros_like(first, dtype=torch.bool)
    seen[:, list(prompt)] = True  # the repetition penalty's: the prompt's tokens, then the first one
    p1 = warp_probs(_repetition(first, seen, sampling.repetition_penalty), sampling)[0].double()
    vocab = p1.shape[0]
    prefixes = torch.tensor([list(prompt)] * vocab)  # [vocab, n]
    inputs = torch.cat([prefixes, torch.arange(vocab)[:, None]], dim=1)  # [vocab, n + 1]
    second = add_bias(model(input_ids=inputs).logits[:, -1], sampling.logit_bias)
    diagonal = torch.arange(vocab)  # after first token x, x was generated once: its penalties
    seen = seen.expand(vocab, -1).clone()
    seen[diagonal, diagonal] = True
    second = _repetition(second, seen, sampling.repetition_penalty)
    second[diagonal, diagonal] -= sampling.frequency_penalty + sampling.presence_penalty
    p2_given = warp_probs(second, sampling).double()  # [vocab, vocab]
    return p1, p1 @ p2_given


def _repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty by hand: a seen token's logit divided where positive, multiplied where not."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def assert_first_tokens_follow_the_target(models, prompt, sampling, results) -> None:
    """The marginals of the results' first two tokens fit the target's exact ones, and (the test's
    power) the same samples do not fit the close draft's."""
    firsts, seconds = [r.token_ids[0] for r in results], [r.token_ids[1] for r in results]
    p1, p2 = exact_marginals(models["target"].model, prompt, sampling)
    assert chi_square_pvalue(firsts, p1) > ALPHA
    assert chi_square_pvalue(seconds, p2) > ALPHA
    q1, q2 = exact_marginals(models["close_draft"].model, prompt, sampling)
    assert chi_square_pvalue(firsts, q1) < ALPHA or chi_square_pvalue(seconds, q2) < ALPHA


def chi_square_pvalue(samples: list[int], probs: torch.Tensor) -> float:
    """Goodness of fit, pooling tokens with expected count < 5 into one bin."""
    n = len(samples)
    counts = torch.bincount(torch.tensor(samples), minlength=probs.shape[0]).double()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if float(obs[exp == 0].sum()) > 0:
        return 0.0
    exp = exp * (obs.sum() / exp.sum())
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("tree", ["off", "cape", "deep"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_first_tokens_follow_the_target(models, prompt_ids, config, tree):
    """SAMPLES seeded requests through the batched engine (50 at a time: its steps are what make
    2,500 draws affordable); the first ALONE of them, run one at a time, are the same draws token
    for token (seeds key every draw by position), so the fit holds for both paths. tree cape: each
    block a token tree, its siblings tried at a rejected place by multi-candidate rejection
    (svip_common/rejection.py, branch_sampled); some are taken, and the fit still holds. tree
    deep: below a sibling taken, its grown child is tried the same way against the target's p
    at the sibling's row; some are taken too (on the short prompt, where this pair's siblings are
    taken most: a grown child in about one round in fifty at t1; warped, its first token is
    all but certain there, and the medium prompt takes none)."""
    sampling = CONFIGS[config]
    prompt = prompt_ids["short" if (tree, config) == ("deep", "t1") else "medium"]
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    policy = PolicyConfig(name="constant", draft_length=3, tree=tree)
    requests = [
        GenerationRequest(prompt, 3, sampling=SamplingParams(**{**vars(sampling), "seed": seed}), policy=policy)
        for seed in range(SAMPLES)
    ]
    results = engine.generate_many(requests, 50)
    alone = [engine.generate(r) for r in requests[:ALONE]]
    assert [r.token_ids for r in alone] == [r.token_ids for r in results[:ALONE]]
    rejections = sum(r.stats.accepted_lengths[0] < r.stats.draft_lengths[0] for r in results)
    assert rejections > SAMPLES // 10  # corrections really happened
    if tree != "off":
        assert sum(r.stats.branches for r in results) > SAMPLES // 20  # siblings really were taken
    if tree == "deep" and config == "t1":  # and children grown below them (warped, top-k cuts most of them)
        assert sum(r.stats.branch_tokens - r.stats.branches for r in results) > 0
    assert_first_tokens_follow_the_target(models, prompt, sampling, results)


@pytest.mark.slow
def test_a_logit_bias_is_the_targets_distribution_biased(models, prompt_ids):
    """logit_bias on the target's and the draft's logits at every drafted place: the first two
    tokens fit the biased target's marginals, and (the test's power) not the unbiased target's."""
    prompt = prompt_ids["medium"]
    p1, _ = exact_marginals(models["target"].model, prompt, SamplingParams(temperature=1.0))
    top = torch.topk(p1, 3).indices.tolist()  # ban the target's likeliest first token, favour its third
    bias = tuple({30: 2.0, top[2]: 1.5, top[0]: -100.0}.items())
    sampling = SamplingParams(temperature=1.0, logit_bias=bias)
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    policy = PolicyConfig(name="constant", draft_length=3)
    requests = [GenerationRequest(prompt, 3, sampling=dataclasses.replace(sampling, seed=seed), policy=policy)
                for seed in range(SAMPLES)]
    results = engine.generate_many(requests, 50)
    assert sum(r.stats.accepted_lengths[0] < r.stats.draft_lengths[0] for r in results) > SAMPLES // 20
    assert_first_tokens_follow_the_target(models, prompt, sampling, results)
    assert chi_square_pvalue([r.token_ids[0] for r in results], p1) < ALPHA
    assert all(top[0] not in r.token_ids for r in results)  # banned


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [dict(presence_penalty=2.0, frequency_penalty=2.0), dict(repetition_penalty=2.0)],
                         ids=["presence and frequency", "repetition"])
def test_penalties_are_the_targets_distribution_penalised(models, prompt_ids, knobs):
    """The penalties on the target's rows by the tokens before each place, the drafted ones
    included (the repetition penalty's: the prompt's too): both first tokens fit the penalised
    target's marginals, the second not the plain one's."""
    sampling = SamplingParams(temperature=1.0, **knobs)
    prompt = prompt_ids["short"]  # its likeliest second token repeats the first: the penalties move it
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    policy = PolicyConfig(name="constant", draft_length=3)
    requests = [GenerationRequest(prompt, 3, sampling=dataclasses.replace(sampling, seed=seed), policy=policy)
                for seed in range(SAMPLES)]
    results = engine.generate_many(requests, 50)
    assert sum(r.stats.accepted_lengths[0] > 0 for r in results) > SAMPLES // 20  # drafted tokens accepted
    assert_first_tokens_follow_the_target(models, prompt, sampling, results)
    _, p2 = exact_marginals(models["target"].model, prompt, SamplingParams(temperature=1.0))
    assert chi_square_pvalue([r.token_ids[1] for r in results], p2) < ALPHA


def test_seeded_runs_reproduce(models, prompt_ids):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    for policy in (PolicyConfig(name="svip", threshold=0.6), PolicyConfig(name="heuristic")):
        request = GenerationRequest(prompt_ids["long"], 40, sampling=sampling, policy=policy)
        first, second = engine.generate(request), engine.generate(request)
        assert first.token_ids == second.token_ids
        assert first.stats.draft_lengths == second.stats.draft_lengths
    other = GenerationRequest(prompt_ids["long"], 40, sampling=SamplingParams(temperature=0.9, seed=99), policy=policy)
    assert engine.generate(other).token_ids != first.token_ids


def test_sampling_without_draft_is_the_target_alone(models, prompt_ids):
    """Without a draft every position is one round, drawn from p; seeded, it reproduces."""
    sampling = SamplingParams(temperature=1.0, seed=5)
    alone = SpeculativeEngine(models["target"], None)
    request = GenerationRequest(prompt_ids["short"], 20, sampling=sampling)
    a, b = alone.generate(request), alone.generate(request)
    assert a.token_ids == b.token_ids and a.stats.rounds == 20


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_through_load_aware_pauses(models, prompt_ids):
    """Mode "all", through the batched engine, with a load that flips between heavy and light
    every other step: blocks capped, sessions paused (the target draws alone) and resumed within
    the first tokens. The marginals are still the target's."""
    from svip_common.step_cost import TargetLoad
    from tests.integration.test_load_aware import HEAVY

    # light enough that a drafted token pays however long this machine's draft forward takes (the
    # gate weighs it by the target alone's rate: 1 token/s here), so the drafting the test asks for
    # does not depend on the machine's speed
    light = TargetLoad(plain_rate=1.0, verify_token_s=0.0001)
    sampling = CONFIGS["t1"]
    prompt = prompt_ids["medium"]
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="all")
    calls = iter(range(10**9))
    engine.verifier.load = lambda sessions=None: HEAVY if next(calls) % 4 < 2 else light
    policy = PolicyConfig(name="constant", draft_length=3)
    requests = [
        GenerationRequest(prompt, 3, sampling=SamplingParams(**{**vars(sampling), "seed": seed}), policy=policy,
                          ignore_eos=True)  # a sample that draws EOS first still has a second token
        for seed in range(SAMPLES)
    ]
    results = engine.generate_many(requests, 50)
    assert sum(r.stats.pauses for r in results) > SAMPLES // 10  # pauses really happened
    assert sum(r.stats.draft_tokens for r in results) > SAMPLES // 2  # and drafting too
    assert_first_tokens_follow_the_target(models, prompt, sampling, results)
