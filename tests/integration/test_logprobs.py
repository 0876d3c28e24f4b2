"""Logprobs of the target (issue 45), with speculation on: every settled token's log-probability
and its place's top alternatives are the target's own, as one forward of the model over the prompt
and the output gives them (the request's logit_bias applied, no warping), whether the token was a
drafted one the target accepted, a correction, a bonus token, a tree's sibling or one the target
settled alone; in process, batched, and through the workers (the in-memory transport, sync and
async, either worker first), greedy and sampled. A request's logprobs past their bound are refused
by name, at the caller and on the wire."""

from __future__ import annotations

import collections

import pytest
import torch

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import MAX_LOGPROBS, GenerationRequest, Limits, SamplingParams
from svip_common.errors import InvalidRequest
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from tests.integration.test_in_memory import DRAFT_FIRST, TARGET_FIRST, make_pair
from tests.policies import POLICIES, TREE_POLICIES
from tests.tolerances import float32_tolerance

ALL = {**POLICIES, **TREE_POLICIES}

MAX_NEW = 20
TOP = 3
SAMPLED = SamplingParams(temperature=0.9, seed=5)


@torch.inference_mode()
def expected_logprobs(target, result, bias=()):
    """The target's log-softmax over one forward of prompt + output, at each generated token's
    place (its padding columns masked and the request's bias added, as the verifier has them)."""
    ids = list(result.prompt_ids) + list(result.token_ids)
    logits = target.model(input_ids=torch.tensor([ids])).logits[0].float()
    logits[:, target.token_limit:] = float("-inf")
    for token, value in bias:
        logits[:, token] += value
    return torch.log_softmax(logits, dim=-1)[len(result.prompt_ids) - 1 : len(ids) - 1]


def assert_the_targets_own(target, result, top=TOP, bias=()):
    rows = expected_logprobs(target, result, bias)
    tol = float32_tolerance(target.model.config, rows.flatten().tolist())
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    for i, (token, lp) in enumerate(zip(result.token_ids, result.logprobs)):
        assert lp.token == token
        assert lp.logprob == pytest.approx(rows[i, token].item(), abs=tol), i
        best = torch.topk(rows[i], top)
        assert len(lp.top) == top
        assert [v for _, v in lp.top] == pytest.approx(best.values.tolist(), abs=tol)
        assert {t for t, _ in lp.top} == set(best.indices.tolist()) or [v for _, v in lp.top][0] == pytest.approx(
            [v for _, v in lp.top][-1], abs=tol)  # a tie may order its ids differently


def test_the_target_alone_reports_its_models_log_softmax(models, prompt_ids):
    alone = SpeculativeEngine(models["target"], None)
    for ids in prompt_ids.values():
        result = alone.generate(GenerationRequest(ids, MAX_NEW, logprobs=TOP))
        assert_the_targets_own(models["target"], result)
    plain = alone.generate(GenerationRequest(prompt_ids["short"], MAX_NEW))
    assert plain.logprobs is None  # not asked: none kept


@pytest.mark.parametrize("policy", ["svip", "constant", "svip-cape"])
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_speculation_reports_the_targets_own_in_process(models, prompt_ids, policy, sampling):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    alone = SpeculativeEngine(models["target"], None)
    params = SamplingParams() if sampling == "greedy" else SAMPLED
    accepted = 0
    for ids in prompt_ids.values():
        request = GenerationRequest(ids, MAX_NEW, params, ALL[policy], logprobs=TOP)
        result = engine.generate(request)
        accepted += result.stats.accepted_tokens
        assert_the_targets_own(models["target"], result)
        if sampling == "greedy":
            reference = alone.generate(request)
            assert result.token_ids == reference.token_ids
            assert [lp.logprob for lp in result.logprobs] == pytest.approx(
                [lp.logprob for lp in reference.logprobs], abs=float32_tolerance(
                    models["target"].model.config, [lp.logprob for lp in reference.logprobs]))
    assert accepted > 0  # speculation stayed on


def test_batched_requests_each_report_their_own(models, prompt_ids):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    requests = [GenerationRequest(ids, MAX_NEW, policy=POLICIES["svip"], logprobs=top)
                for top, ids in zip((0, TOP, None), prompt_ids.values())]
    results = engine.generate_many(requests, batch_size=3)
    assert_the_targets_own(models["target"], results[0], top=0)
    assert_the_targets_own(models["target"], results[1])
    assert results[2].logprobs is None


def test_logprobs_follow_the_requests_bias(models, prompt_ids):
    bias = ((7, 2.5), (11, -1.5))
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    request = GenerationRequest(prompt_ids["medium"], MAX_NEW, SamplingParams(logit_bias=bias), POLICIES["svip"],
                                logprobs=TOP)
    assert_the_targets_own(models["target"], engine.generate(request), bias=bias)


@pytest.mark.parametrize("pipeline", ["sync", "async"])
@pytest.mark.parametrize("schedule", ["target first", "draft first"])
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_through_the_workers(models, prompt_ids, pipeline, schedule, sampling):
    pair = make_pair(models, pipeline, TARGET_FIRST if schedule == "target first" else DRAFT_FIRST)
    params = SamplingParams() if sampling == "greedy" else SAMPLED
    for ids in prompt_ids.values():
        result = pair.generate(GenerationRequest(ids, MAX_NEW, params, POLICIES["svip"], logprobs=TOP))
        assert_the_targets_own(models["target"], result)


@pytest.mark.parametrize("tree", ["svip-cape", "svip-deep"])
def test_a_tree_through_the_workers(models, prompt_ids, tree):
    pair = make_pair(models, "async", DRAFT_FIRST)
    for ids in prompt_ids.values():
        result = pair.generate(GenerationRequest(ids, MAX_NEW, policy=TREE_POLICIES[tree], logprobs=TOP))
        assert_the_targets_own(models["target"], result)


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 2.5])
def test_logprobs_past_their_bound_are_refused_by_name(prompt_ids, bad):
    limits = Limits(tokens=1000, positions=512)
    with pytest.raises(InvalidRequest, match="logprobs must be an integer in"):
        GenerationRequest(prompt_ids["short"], 4, logprobs=bad).validate(limits)


def test_the_wire_refuses_logprobs_past_their_bound():
    start = pb.StartSession(session_id="s", prompt_ids=[1, 2], max_new_tokens=4, logprobs=MAX_LOGPROBS + 1,
                            sampling=convert.sampling_to_proto(SamplingParams()))
    with pytest.raises(InvalidRequest, match="logprobs must be an integer in"):
        convert.start_from_proto(start)
    start.logprobs = MAX_LOGPROBS
    assert convert.start_from_proto(start).logprobs == MAX_LOGPROBS


@torch.inference_mode()
def expected_prompt_logprobs(target, prompt):
    logits = target.model(input_ids=torch.tensor([list(prompt)])).logits[0].float()
    logits[:, target.token_limit:] = float("-inf")
    return torch.log_softmax(logits, dim=-1)[:-1]


def assert_the_prompts_own(target, result, top=TOP):
    rows = expected_prompt_logprobs(target, result.prompt_ids)
    tol = float32_tolerance(target.model.config, rows.flatten().tolist())
    assert len(result.prompt_logprobs) == len(result.prompt_ids) - 1
    for i, lp in enumerate(result.prompt_logprobs):
        assert lp.token == result.prompt_ids[i + 1]
        assert lp.logprob == pytest.approx(rows[i, lp.token].item(), abs=tol)
        assert [v for _, v in lp.top] == pytest.approx(torch.topk(rows[i], top).values.tolist(), abs=tol)


def test_prompt_logprobs_cost_the_prefill_alone(models, prompt_ids):
    """A scoring request (OpenAI's echo with logprobs): the prompt's tokens scored by its prefill,
    which generation then goes on from: the target alone runs as many forwards as without."""
    alone = SpeculativeEngine(models["target"], None)
    for ids in prompt_ids.values():
        scored = alone.generate(GenerationRequest(ids, 4, logprobs=TOP, prompt_logprobs=True))
        plain = alone.generate(GenerationRequest(ids, 4, logprobs=TOP))
        assert_the_prompts_own(models["target"], scored)
        assert scored.token_ids == plain.token_ids and plain.prompt_logprobs is None
        assert scored.stats.target_forwards == plain.stats.target_forwards
        assert_the_targets_own(models["target"], scored)
    one = alone.generate(GenerationRequest(prompt_ids["long"], 1, logprobs=0, prompt_logprobs=True))
    assert one.stats.target_forwards == 1  # max_tokens 0 through Serve: this, its token dropped


@pytest.mark.parametrize("where", ["in process", "sync", "async"])
def test_prompt_logprobs_with_speculation(models, prompt_ids, where):
    if where == "in process":
        engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    else:
        engine = make_pair(models, where, DRAFT_FIRST)
    for ids in prompt_ids.values():
        result = engine.generate(GenerationRequest(ids, MAX_NEW, policy=POLICIES["svip"], logprobs=TOP,
                                                   prompt_logprobs=True))
        assert_the_prompts_own(models["target"], result)
        assert_the_targets_own(models["target"], result)


def test_prompt_logprobs_need_logprobs(prompt_ids):
    with pytest.raises(InvalidRequest, match="prompt_logprobs needs logprobs"):
        GenerationRequest(prompt_ids["short"], 4, prompt_logprobs=True).validate(Limits(tokens=1000, positions=512))
    start = pb.StartSession(session_id="s", prompt_ids=[1, 2], max_new_tokens=4, prompt_logprobs=True,
                            sampling=convert.sampling_to_proto(SamplingParams()))
    with pytest.raises(InvalidRequest, match="prompt_logprobs needs logprobs"):
        convert.start_from_proto(start)


def test_a_long_scoring_request_runs_in_chunks_beside_a_streaming_neighbour(models, prompt_ids, monkeypatch):
    """Review M-1: echo + logprobs over a long prompt is read a prefill chunk at a time inside the
    target's steps (never one forward over the whole prompt holding every row): no forward holds
    more than max_batched_tokens, the neighbour's blocks ride the same forwards meanwhile, and the
    scores are the model's own."""
    budget = 16
    long_prompt = (prompt_ids["long"] * 8)[:300]
    pair = make_pair(models, "async", TARGET_FIRST, max_batched_tokens=budget)
    forwards = []  # per target forward: the tokens each sequence took in
    real = pair.host.verifier.pool.timed_forward

    def recorded(steps, layers=()):
        forwards.append([(id(seq), len(new)) for seq, new, *_ in steps])
        return real(steps, layers)

    monkeypatch.setattr(pair.host.verifier.pool, "timed_forward", recorded)
    neighbour = GenerationRequest(prompt_ids["medium"], 40, policy=POLICIES["svip"], ignore_eos=True)
    scoring = GenerationRequest(long_prompt, 4, logprobs=TOP, prompt_logprobs=True)
    beside, scored = pair.generate_all([neighbour, scoring])
    totals = collections.Counter()
    for step in forwards:
        totals.update(dict(step))
    prompt_seq = max(totals, key=totals.get)  # the scoring request's sequence took the most tokens
    chunked = [step for step in forwards if dict(step).get(prompt_seq, 0) > 1]
    assert len(chunked) >= len(long_prompt) // budget  # the prompt went through in chunks,
    assert all(sum(n for _, n in step) <= budget for step in chunked)  # none past the step's budget,
    assert sum(len(step) > 1 for step in chunked) >= len(chunked) // 2  # the neighbour's steps beside them
    assert_the_prompts_own(models["target"], scored)
    assert beside.token_ids == SpeculativeEngine(models["target"], None).generate(neighbour).token_ids
