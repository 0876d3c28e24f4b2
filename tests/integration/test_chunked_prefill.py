"""Chunked prefill that chunks (the security review's M2): a 32,000-token prompt under a 512-token
budget runs in forwards of at most 512 tokens on both workers, the first chunk included (before,
the first chunk was the only one bounded and the draft prefilled the whole prompt at once), beside
a short session that keeps going; both outputs equal the target alone. Real gRPC on loopback to a
real draft service and session host, on a long-context copy of the tiny pair."""

from __future__ import annotations

import asyncio
import random

import pytest

from coordinator.distributed import DistributedEngine
from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig
from svip_common.models import load_model, load_model_info
from tests.tiny_models import build_model, build_tokenizer, perturbed_copy, save_model
from tests.workers import in_process_workers

POSITIONS = 32_768
PROMPT_TOKENS = 32_000
BUDGET = 512


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    tok = build_tokenizer()
    target = build_model(tok, seed=1, hidden=64, layers=1, max_positions=POSITIONS)  # one layer: ~63 chunks each
    paths = save_model(root / "target", tok, target), save_model(root / "draft", tok, perturbed_copy(target, 0.15, 3))
    return paths, {"target": load_model(paths[0]), "close_draft": load_model(paths[1])}


@pytest.mark.system
def test_a_32000_token_prompt_runs_in_forwards_of_at_most_the_budget_on_both_workers(long_pair, loop):
    (target_path, _), models = long_pair
    rng = random.Random(0)
    long = GenerationRequest(tuple(rng.randrange(3, 300) for _ in range(PROMPT_TOKENS)), 8,
                             policy=PolicyConfig(name="constant", draft_length=4), ignore_eos=True)
    short = GenerationRequest((5, 6, 7, 8), 48, policy=PolicyConfig(name="constant", draft_length=4), ignore_eos=True)
    # the target alone, in process, prefilling in chunks of 4,096 (chunked prefill is exact: test_batching.py)
    reference = SpeculativeEngine(models["target"], None, kv_cache_tokens=POSITIONS + 64).batch(1, 4096)
    expected_long = reference.generate_all([long])[0].token_ids
    with in_process_workers(loop, models, draft_kv_tokens=POSITIONS + 64, target_kv_tokens=POSITIONS + 64,
                            positions=POSITIONS, max_batched_tokens=BUDGET, load_aware="off",
                            draft_stall_s=600.0) as w:  # the target waits for the draft's chunked prefill
        engine = DistributedEngine(load_model_info(target_path), w.limits, w.target_address, w.draft_address, "async")

        async def both():
            await engine.connect()
            try:
                return await asyncio.gather(engine.generate(long), engine.generate(short))
            finally:
                await engine.close()

        results = loop.run_until_complete(both())
        target_max, draft_max = w.host.pool.max_forward_tokens, w.draft.pool.max_forward_tokens
    assert 0 < target_max <= BUDGET and 0 < draft_max <= BUDGET, (target_max, draft_max)
    assert results[0].token_ids == expected_long and len(results[0].token_ids) == 8
    alone = SpeculativeEngine(models["target"], None, kv_cache_tokens=POSITIONS + 64)
    assert results[1].token_ids == alone.generate(short).token_ids
    assert results[0].stats.draft_tokens > 0  # the long prompt was drafted for too, after its chunks
