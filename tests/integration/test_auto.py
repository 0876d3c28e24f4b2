"""The `auto` policy in every mode: greedy output equals the target alone while the pair's estimate
changes under it (in process, batched, distributed sync and async, load-aware or not); the
distributed estimate lives beside the verifier and is exported in the target's Stats; a seeded
sampled request reproduces (its rule is fixed: svip_common/acceptance.py, SessionStop); a stop
rule sent to a session of another policy is INVALID_ARGUMENT."""

from __future__ import annotations

import grpc
import pytest

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from tests.workers import generate_through, in_process_workers

AUTO = PolicyConfig(name="auto")
MAX_NEW = 40


def _requests(prompt_ids, n: int, sampling=SamplingParams()):
    prompts = list(prompt_ids.values())
    return [GenerationRequest(prompts[i % len(prompts)] + (3 + i,), MAX_NEW, sampling, AUTO, ignore_eos=True)
            for i in range(n)]


def _alone(models, requests):
    engine = SpeculativeEngine(models["target"], None)
    return [engine.generate(r).token_ids for r in requests]


@pytest.mark.parametrize("load_aware", ["off", "greedy"])
def test_in_process_greedy_is_exact_while_the_estimate_learns(models, prompt_ids, load_aware):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware=load_aware)
    requests = _requests(prompt_ids, 12)
    prior = engine.auto_estimate().model(True).weights
    outputs = [engine.generate(r).token_ids for r in requests]
    model = engine.auto_estimate().model(True)
    assert model.observed > 0
    if load_aware == "off":  # (load-aware, the gate may pause these tiny models' sessions: fewer verdicts)
        assert model.fits >= 1 and model.weights != prior  # the estimate changed while it served
    assert outputs == _alone(models, requests)


def test_batched_greedy_is_exact_while_the_estimate_learns(models, prompt_ids):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    requests = _requests(prompt_ids, 12)
    results = engine.batch(6).generate_all(requests)
    assert engine.auto_estimate().model(True).fits >= 1
    assert [r.token_ids for r in results] == _alone(models, requests)
    assert sum(r.stats.draft_tokens for r in results) > 0


def test_a_seeded_sampled_request_reproduces_under_auto(models, prompt_ids):
    """Sampled sessions draft by the pair's fixed rule, so their seed reproduces the sample, in a
    fresh engine too, whatever the greedy traffic taught the estimate meanwhile."""
    sampled = _requests(prompt_ids, 3, SamplingParams(temperature=0.9, seed=11))
    engine = SpeculativeEngine(models["target"], models["close_draft"], auto_cost=0.3, load_aware="off")
    first = [engine.generate(r).token_ids for r in sampled]
    for r in _requests(prompt_ids, 8):  # greedy traffic moves the live estimate
        engine.generate(r)
    assert engine.auto_estimate().model(True).fits >= 1
    assert [engine.generate(r).token_ids for r in sampled] == first
    fresh = SpeculativeEngine(models["target"], models["close_draft"], auto_cost=0.3, load_aware="off")
    assert [fresh.generate(r).token_ids for r in sampled] == first


@pytest.fixture(scope="module")
def workers(models, loop):
    with in_process_workers(loop, models, load_aware="off") as w:  # every block drafted: the estimate learns
        yield w


def _run_distributed(w, model_dirs, loop, requests, pipeline):
    return generate_through(loop, w, model_dirs.target, pipeline, requests)


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_distributed_greedy_is_exact_and_the_estimate_lives_beside_the_verifier(
    workers, models, model_dirs, prompt_ids, loop, pipeline
):
    before = workers.host.auto.model(True).observed
    requests = _requests(prompt_ids, 8)
    results = _run_distributed(workers, model_dirs, loop, requests, pipeline)
    assert [r.token_ids for r in results] == _alone(models, requests)
    model = workers.host.auto.model(True)
    assert model.observed > before and model.fits >= 1
    stats = loop.run_until_complete(workers.host.Stats(pb.StatsRequest(), None))
    assert stats.auto_greedy.observed_tokens == model.observed and list(stats.auto_greedy.weights) == list(
        model.weights
    )
    assert 0.0 < stats.auto_greedy.observed_acceptance <= 1.0 and stats.auto_prior_cost > 0


def test_a_stop_rule_for_another_policy_is_invalid_argument(workers, loop):
    async def start_with_rule():
        async with grpc.aio.insecure_channel(workers.draft_address) as channel:
            stub = pb_grpc.DraftWorkerStub(channel)
            start = pb.StartSession(
                session_id="ruled",
                prompt_ids=[5, 6, 7],
                max_new_tokens=4,
                sampling=pb.SamplingParams(top_p=1.0),
                policy=pb.PolicyConfig(name="constant", draft_length=2, max_draft_length=8, entropy_scale=0.15),
                stop_rule=pb.StopRule(weights=[0.0] * 5, stop_at=0.3),
            )
            call = stub.Session(iter([pb.DraftRequest(start=start)]))
            return [event async for event in call]

    events = loop.run_until_complete(start_with_rule())
    errors = [e.error for e in events if e.HasField("error")]
    assert errors and errors[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0], events
    assert "only auto takes one" in errors[0].message
