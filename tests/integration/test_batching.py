"""Continuous batching in one process: every draft forward advances every session that is
drafting, every target forward verifies every ready block (a ragged batch over the paged KV
pools), and the outputs equal the engine's one request at a time, token for token, greedy and
sampled: prompts of different lengths, different SVIP lengths in one step, sessions joining and
leaving mid-run, a long prompt prefilled in chunks. Pages: all free at the end, a request larger
than the pool is a clear error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import Block, GenerationRequest, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from target_worker.verifier import Verifier

POLICIES = [
    PolicyConfig(name="svip", threshold=0.6),
    PolicyConfig(name="constant", draft_length=4),
    PolicyConfig(name="heuristic", draft_length=2),
    PolicyConfig(name="none"),
    PolicyConfig(name="svip", threshold=2.0),
    PolicyConfig(name="auto"),
]


def requests_for(prompt_ids, sampling=SamplingParams()):
    prompts = list(prompt_ids.values())
    return [
        GenerationRequest(
            prompts[i % len(prompts)] + (i,),
            10 + 7 * (i % 5),
            sampling=sampling,
            policy=POLICIES[i % len(POLICIES)],
            ignore_eos=True,
        )
        for i in range(12)
    ]


@pytest.mark.parametrize("batch_size", [1, 4, 12])
def test_batched_greedy_equals_one_at_a_time(models, prompt_ids, batch_size):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    requests = requests_for(prompt_ids)
    alone = [engine.generate(r).token_ids for r in requests]
    batch = engine.batch(batch_size)
    results = batch.generate_all(requests)
    assert [r.token_ids for r in results] == alone
    assert max(batch.batch_sizes) == min(batch_size, len(requests))  # sessions joined as others left
    assert engine.verifier.pool.used_pages == 0 and engine.drafter.pool.used_pages == 0


def test_batched_sampling_equals_one_at_a_time_with_the_same_seeds(models, prompt_ids):
    """Randomness is keyed by (seed, position, purpose): a batch changes no draw."""
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    requests = [
        GenerationRequest(
            r.prompt_ids,
            r.max_new_tokens,
            SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i),
            r.policy,
            ignore_eos=True,
        )
        for i, r in enumerate(requests_for(prompt_ids))
    ]
    alone = [engine.generate(r).token_ids for r in requests]
    assert [r.token_ids for r in engine.batch(6).generate_all(requests)] == alone


def test_a_batch_mixing_greedy_and_differently_warped_sessions_equals_one_at_a_time(models, prompt_ids):
    """A step's rows are warped and drawn in groups of sessions that warp alike (draft and target
    side): greedy, two sampled settings and their seeds side by side change no session's output."""
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    settings = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95), SamplingParams(temperature=1.3, top_k=7)]
    requests = [
        GenerationRequest(r.prompt_ids, r.max_new_tokens, dataclasses.replace(settings[i % 3], seed=11 + i),
                          r.policy, ignore_eos=True)
        for i, r in enumerate(requests_for(prompt_ids))
    ]
    alone = [engine.generate(r).token_ids for r in requests]
    assert [r.token_ids for r in engine.batch(len(requests)).generate_all(requests)] == alone


def test_a_long_prompt_is_prefilled_in_chunks_under_the_token_budget(models, prompt_ids):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    long = GenerationRequest(tuple(range(3, 203)), 12, policy=POLICIES[0], ignore_eos=True)
    short = requests_for(prompt_ids)[:4]
    alone = [engine.generate(r).token_ids for r in [long, *short]]
    batch = engine.batch(8, max_batched_tokens=32)
    assert [r.token_ids for r in batch.generate_all([long, *short])] == alone
    assert batch.steps > 200 // 32  # the 200-token prompt took several steps


def test_a_request_larger_than_the_pool_is_a_clear_error(models):
    engine = SpeculativeEngine(models["target"], models["close_draft"], kv_cache_tokens=64, load_aware="off")
    with pytest.raises(InvalidRequest, match=r"\+ max_new_tokens \(20\) does not fit the KV cache of 64 tokens"):
        engine.generate(GenerationRequest(tuple(range(3, 60)), 20))
    with pytest.raises(InvalidRequest, match="does not fit the KV"):
        engine.batch(2).generate_all([GenerationRequest(tuple(range(3, 60)), 20)])


def test_a_full_pool_makes_requests_wait_not_fail(models, prompt_ids):
    """A pool that holds two sessions at a time serves twelve, each exact."""
    engine = SpeculativeEngine(models["target"], models["close_draft"], kv_cache_tokens=2 * 96, load_aware="off")
    requests = [
        GenerationRequest(r.prompt_ids[:20], 40, policy=r.policy, ignore_eos=True) for r in requests_for(prompt_ids)
    ]
    alone = [engine.generate(r).token_ids for r in requests]
    batch = engine.batch(12)
    assert [r.token_ids for r in batch.generate_all(requests)] == alone
    assert max(batch.batch_sizes) <= 3 and engine.verifier.pool.used_pages == 0


def test_first_tokens_judged_together_equal_each_judged_alone(models):
    """Verifier.judge_first over a step's follow-ups (greedy, and sampled in two warps, q here
    and q with the draft) gives each block the verdict it gets judged alone."""
    target, prompt = models["target"], [5, 17, 42, 8, 99, 23, 61, 7]
    vocab = target.model.config.vocab_size
    warps = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9), SamplingParams(temperature=1.3)]

    def follow_ups(verifier):
        jobs = []
        for i in range(12):
            session = verifier.open(dataclasses.replace(warps[i % 3], seed=i))
            q = torch.softmax(torch.randn(2, vocab, generator=torch.Generator().manual_seed(i)), -1) if i % 2 else None
            first = Block(base=3 + i % 5, tokens=[1, 2], probs=[0.3, 0.3], entropies=[0.0, 0.0], q_rows=q)
            verifier.verify_batch([(session, prompt[: 3 + i % 5], first)])
            choice = int(torch.argmax(session._pending))
            block = Block(base=5 + i % 5, tokens=[choice if i % 4 > 1 else (choice + 1) % vocab, 3], probs=[0.2, 0.3],
                          entropies=[0.0, 0.0], q_rows=q)
            jobs.append((session, [*prompt[: 3 + i % 5], 1, 2], block))
        return jobs

    verifier = Verifier(target, kv_cache_tokens=4096)
    together = verifier.judge_first(follow_ups(verifier))
    jobs = follow_ups(Verifier(target, kv_cache_tokens=4096))
    alone = [session.judge_first(committed, block) for session, committed, block in jobs]
    assert [v is None for v in together] == [v is None for v in alone]
    assert any(v is None for v in alone) and any(v is not None and v.token != -1 for v in alone[1::2])
    for a, b in zip(together, alone):
        if a is not None:
            assert (a.base, a.accepted, a.token) == (b.base, b.accepted, b.token)
            assert (a.p_row is None) == (b.p_row is None)
            assert a.p_row is None or torch.equal(a.p_row, b.p_row)
