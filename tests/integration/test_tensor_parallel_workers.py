"""A tensor-parallel target and draft across the workers (issue 61): each worker (rank 0) and its
rank 1, a Ray actor it starts and owns, gloo on this CPU. Greedy output through both pipelines equals the
target alone; a rank killed mid-stream is the target lost: the group starts again and every session
goes on, exact."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from coordinator.cluster import WorkerPair, init_local_ray
from coordinator.distributed import DistributedEngine
from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig
from svip_common.pair_config import PairConfig
from tests.gates import async_wait_until
from tests.loopback import assert_loopback_listeners

pytestmark = pytest.mark.system  # the second tier (pyproject.toml markers)

NEW = 200


@pytest.fixture(scope="module")
def pair(model_dirs):
    import ray

    init_local_ray(pairs=2)
    pair = WorkerPair(PairConfig(model_dirs.target, model_dirs.close_draft, target_tp=2, draft_tp=2,
                                 load_aware="off"))
    yield pair
    pair.shutdown()
    ray.shutdown()


def requests(prompt_ids, new: int = 40) -> list[GenerationRequest]:
    policies = (PolicyConfig(name="svip", threshold=0.6), PolicyConfig(name="constant", draft_length=4))
    return [GenerationRequest(ids, new, policy=policy, ignore_eos=True)
            for ids in prompt_ids.values() for policy in policies]


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_greedy_through_a_tensor_parallel_target_equals_the_target_alone(pair, models, prompt_ids, loop, pipeline):
    import ray

    engine = DistributedEngine.for_pair(pair, pipeline)
    asked = requests(prompt_ids)

    async def run():
        await engine.connect()
        try:
            return await asyncio.gather(*(engine.generate(r) for r in asked))
        finally:
            await engine.close()

    results = loop.run_until_complete(run())
    alone = SpeculativeEngine(models["target"], None)  # degree 1's tokens: degree 2 gives them (test_tensor_parallel)
    assert [r.token_ids for r in results] == [alone.generate(r).token_ids for r in asked]
    assert sum(r.stats.accepted_tokens for r in results) > 0
    for role, actor in (("target", pair.target), ("draft", pair.draft)):
        placement = ray.get(actor.rank_pids.remote(), timeout=60)
        assert len(placement) == 1 and placement[0] != pair.pids()[role]  # rank 1 in a process of its own
    assert_loopback_listeners()


def test_a_rank_killed_mid_stream_is_the_target_lost_and_every_session_goes_on_exact(pair, models, prompt_ids,
                                                                                       loop, target_gate):
    import ray

    engine = DistributedEngine.for_pair(pair, "async")
    asked = requests(prompt_ids, NEW)
    (rank_pid,) = ray.get(pair.target.rank_pids.remote(), timeout=60)
    target_pid = pair.pids()["target"]

    async def run():
        await engine.connect()
        try:
            with target_gate.held(3):
                tasks = [asyncio.create_task(engine.generate(r)) for r in asked]
                await async_wait_until(lambda: asyncio.sleep(0, target_gate.holding()), what="the target holding")
                assert not any(t.done() for t in tasks), "a session ended before the fault"
                os.kill(rank_pid, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 600)
        finally:
            await engine.close()

    results = loop.run_until_complete(run())
    alone = SpeculativeEngine(models["target"], None)
    assert [r.token_ids for r in results] == [alone.generate(r).token_ids for r in asked]
    assert any(r.stats.target_restarts for r in results)
    assert pair.pids()["target"] != target_pid  # the group started again: a new rank 0 ...
    assert ray.get(pair.target.rank_pids.remote(), timeout=60) != [rank_pid]  # ... and a new rank 1
