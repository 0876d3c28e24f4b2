"""logit_bias (issue 45): added to the target's logits, and the draft's, at every place before
anything reads them, so greedy output equals the target decoding alone with the same bias, token
for token, in process, batched and through the workers (the in-memory transport, sync and async),
while speculation stays on; a bias the request may not send is refused by name. (Sampled: the
biased target's distribution, tests/integration/test_sampling_exact.py.)"""

from __future__ import annotations

import pytest

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, Limits, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from tests.integration.test_in_memory import DRAFT_FIRST, make_pair

MAX_NEW = 24
SVIP = PolicyConfig(name="svip", threshold=0.6)


@pytest.fixture(scope="module")
def biased(models, prompt_ids):
    """Per prompt: a bias that bans the target alone's first two choices and favours two ids,
    the request, and the target alone's output with it (checked to differ from the unbiased)."""
    alone = SpeculativeEngine(models["target"], None)
    out = {}
    for name, ids in prompt_ids.items():
        plain = alone.generate(GenerationRequest(ids, MAX_NEW)).token_ids
        bias = tuple({7: 2.5, 11: 1.5, plain[0]: -100.0, plain[1]: -100.0}.items())
        request = GenerationRequest(ids, MAX_NEW, SamplingParams(logit_bias=bias), SVIP)
        expected = alone.generate(request).token_ids
        assert expected != plain and plain[0] not in expected and plain[1] not in expected
        out[name] = (request, expected)
    return out


def test_in_process_one_at_a_time_and_batched(models, biased):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    requests = [request for request, _ in biased.values()]
    expected = [tokens for _, tokens in biased.values()]
    one = [engine.generate(r) for r in requests]
    assert [r.token_ids for r in one] == expected
    assert sum(r.stats.accepted_tokens for r in one) > 0  # speculation stayed on, and paid
    assert [r.token_ids for r in engine.generate_many(requests, len(requests))] == expected


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_through_the_workers(models, biased, pipeline):
    requests = [request for request, _ in biased.values()]
    results = make_pair(models, pipeline, DRAFT_FIRST).generate_all(requests)
    assert [r.token_ids for r in results] == [tokens for _, tokens in biased.values()]
    assert sum(r.stats.accepted_tokens for r in results) > 0


def test_a_biased_request_batched_with_plain_ones_leaves_them_alone(models, prompt_ids, biased):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    plain = [GenerationRequest(ids, MAX_NEW, policy=SVIP) for ids in prompt_ids.values()]
    mixed = [item for pair in zip(plain, (r for r, _ in biased.values())) for item in pair]
    results = engine.generate_many(mixed, len(mixed))
    alone = SpeculativeEngine(models["target"], None)
    assert [r.token_ids for r in results] == [alone.generate(r).token_ids for r in mixed]


@pytest.mark.parametrize("bias, words", [
    (tuple((i, 1.0) for i in range(301)), "at most 300"),
    (((5, 1.0), (5, 2.0)), "twice"),
    (((5, 101.0),), "must be in \\[-100, 100\\]"),
    (((5, float("nan")),), "must be in \\[-100, 100\\]"),
    (((-1, 1.0),), "outside \\[0, 2\\^31\\)"),
    (((320, 1.0),), "logit_bias token id 320 is outside the vocabulary"),
])
def test_a_bias_past_the_bounds_is_refused_by_name(models, prompt_ids, bias, words):
    request = GenerationRequest(prompt_ids["short"], 4, SamplingParams(logit_bias=bias))
    with pytest.raises(InvalidRequest, match=words):
        request.validate(Limits(tokens=models["target"].token_limit, positions=512))
