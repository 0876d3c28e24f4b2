"""One request cannot fail its neighbours (issue 40; the security review's N1): a batched step
whose work raises for one request's parameters is narrowed to that request, in process and on
both workers, and everyone batched with it gets the output it would have had alone.

The fault is injected where a request's own parameters act, the warp of its distribution
(target_worker/verifier.py and draft_worker/drafter.py call svip_common.sampling.warp_probs), and
raises only for a request that carries a marker top_k: a stand-in for any parameter a worker
cannot serve (N1's top_p under float32's resolution was one, before its fix)."""

from __future__ import annotations

import dataclasses

import pytest

import draft_worker.drafter
import target_worker.verifier
from coordinator.engine import SpeculativeEngine
from svip_common.contracts import Block, GenerationRequest, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest, SvipError
from tests.knob_extremes import served as served_extremes
from tests.knob_extremes import top1
from tests.workers import generate_through, in_process_workers

MARKER_TOP_K = 277  # a top_k no other test uses: the injected fault fires for it alone
SIDES = {"target": target_worker.verifier, "draft": draft_worker.drafter}


def inject_warp_fault(monkeypatch, side: str) -> list[int]:
    """The side's warp raises for a row group whose parameters carry the marker; returns a
    counter of the faults raised."""
    module, raised = SIDES[side], [0]
    real = module.warp_probs

    def warp(logits, params):
        if params.top_k == MARKER_TOP_K:
            raised[0] += 1
            raise RuntimeError("this request's parameters break the warp")
        return real(logits, params)

    monkeypatch.setattr(module, "warp_probs", warp)
    return raised


def mixed_requests(prompt_ids) -> list[GenerationRequest]:
    """Greedy and sampled neighbours around the one that fails (sampled, so both sides warp it)."""
    short, medium, long = prompt_ids["short"], prompt_ids["medium"], prompt_ids["long"]
    constant, svip = PolicyConfig(name="constant", draft_length=4), PolicyConfig(name="svip", threshold=0.6)
    return [
        GenerationRequest(medium, 24, policy=constant, ignore_eos=True),
        GenerationRequest(short, 24, SamplingParams(temperature=0.9, seed=3), svip, ignore_eos=True),
        GenerationRequest(long, 24, SamplingParams(temperature=0.9, top_k=MARKER_TOP_K, seed=4), constant,
                          ignore_eos=True),
        GenerationRequest(short + (7,), 24, policy=svip, ignore_eos=True),
    ]


@pytest.mark.parametrize("side", sorted(SIDES))
def test_in_process_a_failing_request_ends_alone_and_its_batch_is_unchanged(models, prompt_ids, monkeypatch, side):
    reqs = mixed_requests(prompt_ids)
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    alone = [engine.generate(r) for i, r in enumerate(reqs) if i != 2]  # one at a time, nothing injected
    raised = inject_warp_fault(monkeypatch, side)
    results = engine.generate_many(reqs, batch_size=4)
    assert raised[0] >= 1
    bad = results.pop(2)
    assert bad.finish_reason == "error" and "RuntimeError" in bad.error
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]  # greedy and seeded sampled alike
    assert all(r.finish_reason == "length" and r.error is None for r in results)
    assert engine.verifier.pool.free_pages == engine.verifier.pool.pages  # the failed session's pages came back


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_on_the_workers_a_failing_verification_fails_its_request_alone(models, model_dirs, prompt_ids, loop,
                                                                       monkeypatch, pipeline):
    """The target's batched step raised for every session in it before; now the failing one is
    found (in halves) and only its caller gets an error, one that says so."""
    reqs = mixed_requests(prompt_ids)
    inject_warp_fault(monkeypatch, "target")
    with in_process_workers(loop, models, load_aware="off") as w:
        results = generate_through(loop, w, model_dirs.target, pipeline, reqs, return_exceptions=True)
        # Stats waits for the host's compute thread to run a no-op, behind the step that sent the
        # last event and closed its session then: by construction, not by the machine's speed
        stats = loop.run_until_complete(w.host.Stats(None, None))
        assert not w.host.sessions  # every session ended, the failed one too
    assert any(h.startswith("SVIP_TEST_GATE_DIR=") for h in stats.test_hooks)  # the suite's own hook, reported
    bad = results.pop(2)
    assert isinstance(bad, SvipError) and "failed in the target's verification" in str(bad)
    assert "not affected" in str(bad)
    target_alone = SpeculativeEngine(models["target"], None)
    greedy = [reqs[0], reqs[3]]
    assert [results[0].token_ids, results[2].token_ids] == [target_alone.generate(r).token_ids for r in greedy]
    assert results[1].finish_reason == "length" and len(results[1].token_ids) == 24


def test_on_the_workers_a_failing_draft_block_sheds_its_session_alone(models, model_dirs, prompt_ids, loop,
                                                                      monkeypatch):
    """The draft's batched step shed every session in it when one block's choice raised; now only
    that session is shed (its target goes on alone, exact), and the others keep their drafts."""
    reqs = mixed_requests(prompt_ids)
    raised = inject_warp_fault(monkeypatch, "draft")
    with in_process_workers(loop, models, load_aware="off") as w:
        results = generate_through(loop, w, model_dirs.target, "async", reqs)
        shed = w.draft.shed
    assert raised[0] >= 1 and shed == 1
    assert results[2].stats.detached == 1 and results[2].stats.draft_tokens == 0  # it went on alone
    assert all(r.stats.detached == 0 and r.stats.draft_tokens > 0 for i, r in enumerate(results) if i != 2)
    target_alone = SpeculativeEngine(models["target"], None)
    assert [results[0].token_ids, results[3].token_ids] == [target_alone.generate(r).token_ids
                                                            for r in (reqs[0], reqs[3])]
    assert all(len(r.token_ids) == 24 for r in results)


def test_isolating_costs_forwards_in_halves_not_one_per_session(models, prompt_ids, monkeypatch):
    """One bad job among eight: the step, then halves that hold it (2·log2(8) more verifications
    at most), not one forward per session."""
    engine = SpeculativeEngine(models["target"], None)
    verifier = engine.verifier
    calls = []
    real = verifier.verify_batch

    def counted(jobs, budget=None, riders=(), lookahead=None):
        calls.append(len(jobs))
        return real(jobs, budget, riders, lookahead)

    monkeypatch.setattr(verifier, "verify_batch", counted)
    inject_warp_fault(monkeypatch, "target")
    sessions = []
    for i in range(8):
        sampling = SamplingParams(temperature=0.9, seed=i, top_k=MARKER_TOP_K if i == 5 else 0)
        sessions.append((verifier.open(sampling), list(prompt_ids["short"]) + [i]))
    jobs = [(s, committed, Block(base=len(committed), tokens=[], probs=[], entropies=[])) for s, committed in sessions]
    verdicts = verifier.verify_apart(jobs)
    assert [isinstance(v, Exception) for v in verdicts] == [i == 5 for i in range(8)]
    assert len(calls) <= 1 + 2 * 3
    for session, _ in sessions:
        session.close()



def extremes_with_neighbours(models, prompt_ids, limits) -> tuple[list, list[int]]:
    """Every served extreme (tests/knob_extremes.py) and, after every fourth, a well-formed greedy
    neighbour: the requests, and where the neighbours are."""
    served = [request for _, request in served_extremes(prompt_ids["medium"], limits)]
    neighbour = GenerationRequest(prompt_ids["short"], 12, policy=PolicyConfig(name="svip", threshold=0.6),
                                  ignore_eos=True)
    reqs, at = [], []
    for i, request in enumerate(served):
        if i % 4 == 0:
            at.append(len(reqs))
            reqs.append(neighbour)
        reqs.append(request)
    return reqs, at


def check_extremes(results, reqs, at, models) -> None:
    """Every request served to its length; the neighbours and every top-1 request equal to the
    target decoding greedily alone."""
    target_alone = SpeculativeEngine(models["target"], None)
    greedy = {}
    for i, (request, result) in enumerate(zip(reqs, results)):
        if isinstance(result, InvalidRequest) and i not in at:  # refused by name (a 400 through Serve)
            assert request.policy.threshold == "auto" and "in-process only" in str(result)
            continue
        assert not isinstance(result, Exception), (request, result)
        if result.finish_reason == "stop":  # on one of its stop_token_ids, never sooner
            assert result.token_ids[-1] in request.stop_token_ids, request
            assert not set(result.token_ids[:-1]) & set(request.stop_token_ids), request
            continue
        assert result.finish_reason == "length" and len(result.token_ids) == request.max_new_tokens, request
        if i in at or top1(request):
            key = (request.prompt_ids, request.max_new_tokens, dataclasses.replace(request.sampling, seed=0))
            if key not in greedy:
                greedy_knobs = dataclasses.replace(request.sampling, temperature=0.0, top_k=0, top_p=1.0, seed=0)
                plain = dataclasses.replace(request, sampling=greedy_knobs, policy=PolicyConfig(name="none"))
                greedy[key] = target_alone.generate(plain).token_ids
            assert result.token_ids == greedy[key], request


def test_in_process_every_extreme_is_served_and_its_neighbours_are_unchanged(models, prompt_ids):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    reqs, at = extremes_with_neighbours(models, prompt_ids, engine.limits)
    assert len(reqs) > 40
    check_extremes(engine.generate_many(reqs, batch_size=8), reqs, at, models)


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_on_the_workers_every_extreme_is_served_and_its_neighbours_are_unchanged(models, model_dirs, prompt_ids,
                                                                                 loop, pipeline):
    with in_process_workers(loop, models) as w:
        reqs, at = extremes_with_neighbours(models, prompt_ids, w.limits)
        results = generate_through(loop, w, model_dirs.target, pipeline, reqs, return_exceptions=True)
    check_extremes(results, reqs, at, models)
