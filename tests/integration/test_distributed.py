"""The distributed pipeline on real gRPC on loopback, the session host and the draft service in
this process (tests/workers.py; no Ray: the Ray actors' own checks are test_local_ray.py's and
test_recovery.py's): greedy output equal to the in-process engine and to the target alone in sync
and async mode, for three policies and for 8 concurrent sessions (every policy, random
interleavings and the sampling distribution: test_in_memory.py, the same protocol without
sockets; the distribution over gRPC: the system tier); stale blocks never verified;
cancellation frees both caches; greedy wire bytes are ids and small headers; a bad request is
INVALID_ARGUMENT and the stream goes on."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.distributed import DistributedEngine
from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.models import load_model_info
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from tests.gates import async_wait_until
from tests.integration.test_sampling_exact import ALPHA, chi_square_pvalue, exact_marginals
from tests.policies import POLICIES
from tests.workers import in_process_workers

MAX_NEW = 40


@pytest.fixture(scope="module")
def workers(models, loop):
    # these tests check the pipeline's drafting mechanics, so every block is drafted as the
    # policy says; load-aware caps and pauses are tested in test_load_aware.py. The target takes in
    # what a waiting session needs first whenever it idles (not only where that pays), so every
    # check here also runs through blocks judged against rows computed ahead of them
    with in_process_workers(loop, models, load_aware="off", idle_prefill="always") as w:
        yield w


@pytest.fixture(scope="module")
def engines(workers, model_dirs, loop):
    out = {}
    for mode in ("sync", "async"):
        engine = DistributedEngine(load_model_info(model_dirs.target), workers.limits, workers.target_address,
                                   workers.draft_address, mode)
        loop.run_until_complete(engine.connect())
        out[mode] = engine
    yield out
    for engine in out.values():
        loop.run_until_complete(engine.close())


@pytest.fixture(scope="module")
def inprocess(models):
    return SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("policy", ["svip", "auto", "none"])  # every policy: test_in_memory.py, same protocol
def test_greedy_equals_inprocess_and_target_alone(engines, inprocess, models, prompt_ids, loop, mode, policy):
    alone = SpeculativeEngine(models["target"], None)
    for name, ids in prompt_ids.items():
        request = GenerationRequest(ids, MAX_NEW, policy=POLICIES[policy])
        result = loop.run_until_complete(engines[mode].generate(request))
        assert result.token_ids == inprocess.generate(request).token_ids == alone.generate(request).token_ids, (
            mode,
            policy,
            name,
        )
        assert result.finish_reason == "length"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_eight_concurrent_sessions_each_equal_their_run_alone(engines, inprocess, prompt_ids, loop, mode):
    prompts = list(prompt_ids.values())
    requests = [
        GenerationRequest(prompts[i % len(prompts)], 24 + 3 * i, policy=list(POLICIES.values())[i % 4])
        for i in range(8)
    ]

    async def all_at_once():
        return await asyncio.gather(*(engines[mode].generate(r) for r in requests))

    results = loop.run_until_complete(all_at_once())
    for request, result in zip(requests, results):
        assert result.token_ids == inprocess.generate(request).token_ids


def test_async_discards_stale_blocks_without_verifying_them(models, model_dirs, prompt_ids, loop):
    """On workers whose target waits while no block is ready (idle_prefill "off"): where it
    settles its own tokens meanwhile, a block is mostly judged against them as it comes, before
    the follow-up is drafted (test_idle_prefill.py counts the tokens judged so)."""
    request = GenerationRequest(prompt_ids["long"], 60, policy=POLICIES["constant"])
    with in_process_workers(loop, models, load_aware="off", idle_prefill="off") as w:
        engine = DistributedEngine(load_model_info(model_dirs.target), w.limits, w.target_address, w.draft_address,
                                   "async")
        loop.run_until_complete(engine.connect())
        try:
            stats = loop.run_until_complete(engine.generate(request)).stats
            after = loop.run_until_complete(engine.worker_stats())
        finally:
            loop.run_until_complete(engine.close())
    verified, drafted = after["target"].tokens_processed, after["draft"].tokens_processed
    assert stats.discarded_tokens > 0  # rejections happened while the next block was drafted
    assert verified == sum(stats.draft_lengths)  # only current-epoch blocks reached the target
    assert drafted == sum(stats.draft_lengths) + stats.discarded_tokens


def test_async_overlaps_draft_and_target(engines, prompt_ids, loop):
    stats = loop.run_until_complete(
        engines["async"].generate(GenerationRequest(prompt_ids["long"], 60, policy=POLICIES["constant"]))
    ).stats
    assert stats.both_busy_s > 0
    workers = {w for w, _, _ in stats.timeline}
    assert workers == {"draft", "target"}


def test_greedy_wire_bytes_are_ids_and_small_headers(engines, prompt_ids, loop, models):
    stats = loop.run_until_complete(
        engines["async"].generate(GenerationRequest(prompt_ids["short"], 60, policy=POLICIES["constant"]))
    ).stats
    mean_k = sum(stats.draft_lengths) / stats.rounds
    # per round: the block twice (draft -> coordinator -> target), verdict, feedback, each with a
    # 32-byte session id; tokens <= 3 bytes, entropies 4 bytes; no vocabulary-sized vector
    assert stats.wire_bytes_per_round < 400 + 2 * 8 * mean_k
    assert stats.wire_bytes_per_round < models["target"].vocab_size * 4


def test_sampled_rejections_ship_one_row_not_k(engines, prompt_ids, loop, models):
    request = GenerationRequest(
        prompt_ids["short"], 40, sampling=SamplingParams(temperature=1.0, seed=3), policy=POLICIES["constant"]
    )
    stats = loop.run_until_complete(engines["sync"].generate(request)).stats
    rejections = sum(a < d for a, d in zip(stats.accepted_lengths, stats.draft_lengths))
    row = models["target"].vocab_size * 4
    assert rejections > 0
    # one row per rejection, relayed target -> coordinator -> draft; never one per drafted token
    assert stats.wire_bytes < 2 * rejections * (row + 64) + stats.rounds * 600
    assert stats.wire_bytes < sum(stats.draft_lengths) * row


@pytest.mark.slow
@pytest.mark.system  # the fast tier checks the distribution through the in-memory transport (test_in_memory.py)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0),
                                      SamplingParams(temperature=0.8, top_k=40, top_p=0.9)], ids=["plain", "warped"])
def test_sampling_distribution_through_the_pipeline(engines, models, prompt_ids, loop, mode, sampling):
    """Warped, a rejection's p row has few ids with mass and crosses the wire by them (p_nonzero)."""
    prompt = prompt_ids["medium"]
    policy = PolicyConfig(name="constant", draft_length=3)
    requests = [
        GenerationRequest(prompt, 3, sampling=dataclasses.replace(sampling, seed=s), policy=policy)
        for s in range(1500)
    ]

    async def run_all():
        out = []
        for i in range(0, len(requests), 50):
            out += await asyncio.gather(*(engines[mode].generate(r) for r in requests[i : i + 50]))
        return out

    results = loop.run_until_complete(run_all())
    p1, p2 = exact_marginals(models["target"].model, prompt, sampling)
    assert chi_square_pvalue([r.token_ids[0] for r in results], p1) > ALPHA
    assert chi_square_pvalue([r.token_ids[1] for r in results], p2) > ALPHA
    q1, q2 = exact_marginals(models["close_draft"].model, prompt, sampling)
    if sampling.top_p == 1.0:
        assert chi_square_pvalue([r.token_ids[0] for r in results], q1) < ALPHA
    else:  # the test tells the draft's distribution from the target's here too
        assert (chi_square_pvalue([r.token_ids[0] for r in results], q1) < ALPHA
                or chi_square_pvalue([r.token_ids[1] for r in results], q2) < ALPHA)
        rejections = sum(a < d for r in results for a, d in zip(r.stats.accepted_lengths, r.stats.draft_lengths))
        row = models["target"].vocab_size * 4  # a whole float32 p row
        assert rejections > 0 and sum(r.stats.wire_bytes for r in results) < rejections * row / 2  # rows by ids


@pytest.mark.parametrize("tree", ["off", "cape"])
def test_seeded_sampling_reproduces_across_runs(engines, prompt_ids, loop, tree):
    """tree cape: the blocks are token trees whose q rows cross gRPC; the target draws every
    correction and sibling by the seed, as the draft draws a chain's."""
    policy = dataclasses.replace(POLICIES["svip"], tree=tree)
    request = GenerationRequest(prompt_ids["long"], 30, sampling=SamplingParams(temperature=0.9, seed=11),
                                policy=policy)
    first = loop.run_until_complete(engines["async"].generate(request))
    second = loop.run_until_complete(engines["async"].generate(request))
    assert first.token_ids == second.token_ids and first.stats.detached == 0
    assert (first.stats.tree_nodes > first.stats.draft_tokens) == (tree == "cape")


def test_cancelled_session_frees_both_caches(engines, prompt_ids, loop, target_gate):
    """The target verifies twice (the prompt's prefill and a verdict), then holds: the session is
    open on both workers and cannot end by itself, whatever the machine's speed, when it is cancelled."""
    engine = engines["async"]

    async def start_then_cancel():
        with target_gate.held(steps=2):
            task = asyncio.create_task(
                engine.generate(
                    GenerationRequest(prompt_ids["short"], 400, policy=POLICIES["constant"], ignore_eos=True)
                )
            )
            await async_wait_until(lambda: asyncio.sleep(0, target_gate.holding()), what="the target holding")
            busy = await engine.worker_stats()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

            async def freed():
                stats = await engine.worker_stats()
                return all(stats[role].open_sessions == 0 for role in ("target", "draft"))

            await async_wait_until(freed, what="both workers closing the session")
            return busy, await engine.worker_stats()

    busy, after = loop.run_until_complete(start_then_cancel())
    assert busy["target"].open_sessions == 1 and busy["target"].cached_tokens > 0
    assert after["target"].open_sessions == 0 and after["draft"].open_sessions == 0
    assert after["target"].cached_tokens == 0 and after["draft"].cached_tokens == 0


def test_bad_request_is_invalid_argument_and_the_stream_goes_on(workers, loop):
    async def exchange():
        async with grpc.aio.insecure_channel(workers.target_address) as channel:
            stub = pb_grpc.TargetWorkerStub(channel)
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="svip.v1.TargetWorker")
            )
            requests = asyncio.Queue()

            async def gen():
                while (r := await requests.get()) is not None:
                    yield r

            call = stub.Generate(gen())
            requests.put_nowait(pb.GenerateRequest(cancel=pb.Cancel(session_id="ghost")))
            first = await call.read()
            requests.put_nowait(
                pb.GenerateRequest(start=pb.StartSession(session_id="s", prompt_ids=[1, 99999], max_new_tokens=5))
            )
            second = await call.read()
            start = pb.StartSession(
                session_id="ok",
                prompt_ids=[1, 2],
                max_new_tokens=5,
                sampling=pb.SamplingParams(top_p=1.0),
                policy=pb.PolicyConfig(name="none"),
            )
            requests.put_nowait(pb.GenerateRequest(start=start))
            rest = []
            while not rest or rest[-1].WhichOneof("kind") != "finished":
                rest.append(await call.read())
            requests.put_nowait(None)
            return health, first, second, rest

    health, first, second, rest = loop.run_until_complete(exchange())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert first.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "no session 'ghost'" in first.error.message
    assert "outside the vocabulary" in second.error.message
    assert sum(len(e.settled.tokens) for e in rest[:-1]) == 5 and rest[-1].finished.finish_reason in ("length", "stop")


def test_distributed_rejects_bad_requests_with_named_errors(engines, loop):
    with pytest.raises(InvalidRequest, match="top_p"):
        loop.run_until_complete(
            engines["async"].generate(GenerationRequest((1, 2), 5, sampling=SamplingParams(temperature=1.0, top_p=0.0)))
        )
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        loop.run_until_complete(engines["async"].generate(GenerationRequest((1, 10**6), 5)))
