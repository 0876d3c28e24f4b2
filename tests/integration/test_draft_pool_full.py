"""A draft worker whose KV pool cannot hold all its sessions gives the youngest up (a shed Closed)
instead of failing its batched step; their targets go on alone, at once, and every output stays
exact. Real gRPC on loopback to a real draft service (a pool of 128 tokens) and a real session host,
hosted here without Ray."""

from __future__ import annotations

import asyncio
import logging

import pytest

from coordinator.distributed import DistributedEngine
from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_common.models import load_model_info
from svip_runtime.grpc_server import draft_stats
from tests.workers import assert_all_freed, in_process_workers

DRAFT_POOL_TOKENS = 128


@pytest.fixture(scope="module")
def workers(models, loop):
    with in_process_workers(loop, models, draft_kv_tokens=DRAFT_POOL_TOKENS, load_aware="off") as w:
        yield w.host, w.draft, w.limits, w.target_address, w.draft_address


def test_a_full_draft_pool_sheds_its_youngest_sessions_and_every_output_stays_exact(
        workers, models, model_dirs, prompt_ids, loop, caplog):
    host, draft, limits, target_address, draft_address = workers
    policies = [PolicyConfig(name="constant", draft_length=4), PolicyConfig(name="svip", threshold=0.6)]
    prompts = list(prompt_ids.values())
    greedy = [GenerationRequest(prompts[i % len(prompts)] + (i,), 40, policy=policies[i % 2], ignore_eos=True)
              for i in range(8)]
    sampled = GenerationRequest(prompts[1], 40, SamplingParams(temperature=0.9, seed=5), policies[0], ignore_eos=True)
    engine = DistributedEngine(load_model_info(model_dirs.target), limits, target_address, draft_address, "async")

    async def run_all():
        await engine.connect()
        try:
            return await asyncio.gather(*(engine.generate(r) for r in [*greedy, sampled]))
        finally:
            await engine.close()

    with caplog.at_level(logging.WARNING):
        results = loop.run_until_complete(run_all())
    alone = SpeculativeEngine(models["target"], None)
    assert [r.token_ids for r in results[:-1]] == [alone.generate(r).token_ids for r in greedy]
    assert len(results[-1].token_ids) == 40 and results[-1].finish_reason == "length"
    # each shed that reached a session still running detached it (a target that had finished its
    # session first has nothing to detach: the shed then ends a session the draft still held)
    assert draft.shed > 0 and 0 < sum(r.stats.detached for r in results) <= draft.shed
    assert loop.run_until_complete(draft_stats(draft_address)).sessions_shed == draft.shed  # what Prometheus reads
    assert sum(r.stats.accepted_tokens for r in results) > 0  # the sessions that fit still speculated
    assert "shed" in caplog.text and "unhandled" not in caplog.text
    # a shed session goes on alone at once: no waiting out the stall deadline or a sampled hold
    assert all(r.stats.reattached == 0 for r in results)
    assert_all_freed(host, draft, loop, timeout=300)
