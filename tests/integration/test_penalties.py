"""Presence, frequency and repetition penalties and min_tokens (issue 45), exact under speculation: each row
the target judges is adjusted by the tokens before its own place, the drafted path up to it
included (svip_common/row_rules.py), so greedy output equals the target decoding alone with the
same knobs, token for token, in process, batched, as token trees, and through the workers (the
in-memory transport, sync and async), with speculation on. (Sampled: the chi-square test in
tests/integration/test_sampling_exact.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from tests.integration.test_in_memory import DRAFT_FIRST, make_pair

MAX_NEW = 24
SVIP = PolicyConfig(name="svip", threshold=0.6)
KNOBS = {
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=2.0),
    "both, negative": dict(presence_penalty=-0.5, frequency_penalty=0.8),
    "repetition": dict(repetition_penalty=1.8),  # over the prompt's tokens too
    "repetition below one, with presence": dict(repetition_penalty=0.6, presence_penalty=1.0),
}


@pytest.fixture(scope="module")
def cases(models, prompt_ids):
    """Per knob and prompt: the request and the target alone's output with it; the knobs change
    the output (checked), and min_tokens holds back a stop id the target alone would choose."""
    alone = SpeculativeEngine(models["target"], None)
    out = []
    for knob, values in KNOBS.items():
        for name, ids in prompt_ids.items():
            request = GenerationRequest(ids, MAX_NEW, SamplingParams(**values), SVIP)
            out.append((f"{knob}-{name}", request, alone.generate(request).token_ids))
    changed = sum(tokens != alone.generate(dataclasses.replace(r, sampling=SamplingParams())).token_ids
                  for _, r, tokens in out)
    assert changed >= len(out) // 2
    for name, ids in prompt_ids.items():
        plain = alone.generate(GenerationRequest(ids, MAX_NEW)).token_ids
        stop = plain[3]  # the target alone would stop there
        request = GenerationRequest(ids, MAX_NEW, SamplingParams(min_tokens=8, frequency_penalty=0.3), SVIP,
                                    stop_token_ids=(stop,))
        tokens = alone.generate(request).token_ids
        assert stop not in tokens[:8]
        out.append((f"min_tokens-{name}", request, tokens))
    return out


@pytest.mark.parametrize("tree", ["off", "cape", "deep"])
def test_in_process_one_at_a_time_and_batched(models, cases, tree):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    requests = [dataclasses.replace(r, policy=dataclasses.replace(r.policy, tree=tree)) for _, r, _ in cases]
    expected = [tokens for _, _, tokens in cases]
    one = [engine.generate(r) for r in requests]
    assert [r.token_ids for r in one] == expected, [name for (name, _, t), r in zip(cases, one) if t != r.token_ids]
    assert sum(r.stats.accepted_tokens for r in one) > 0
    assert [r.token_ids for r in engine.generate_many(requests, 8)] == expected


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_through_the_workers(models, cases, pipeline):
    requests = [dataclasses.replace(r, policy=dataclasses.replace(r.policy, tree="cape")) if i % 2 else r
                for i, (_, r, _) in enumerate(cases)]
    results = make_pair(models, pipeline, DRAFT_FIRST).generate_all(requests)
    assert [r.token_ids for r in results] == [tokens for _, _, tokens in cases]
    assert sum(r.stats.accepted_tokens for r in results) > 0
