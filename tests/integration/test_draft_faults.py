"""Draft-side faults degrade, never loop (the security review's M3), on a real draft service and a
real session host serving gRPC on loopback, hosted here without Ray: a draft whose every step
raises sheds the step's sessions once (their targets go on alone, exact, and never re-attach into
the same failure); a draft that answers a session with an error leaves it to the target alone (never
the caller's error); a re-attach after a stall waits out a backoff that doubles."""

from __future__ import annotations

import logging

import pytest

from coordinator.engine import SpeculativeEngine
from coordinator.session.pipeline import SessionPipeline
from coordinator.session.reattach import REATTACH_BACKOFF_S
from svip_common.contracts import GenerationRequest, Limits, PolicyConfig, SamplingParams
from svip_common.messages import DraftedBlock
from target_worker.verifier import Verifier
from tests.workers import generate_through, in_process_workers

POLICIES = [PolicyConfig(name="constant", draft_length=4), PolicyConfig(name="svip", threshold=0.6)]


def requests(prompt_ids) -> list[GenerationRequest]:
    prompts = list(prompt_ids.values())
    greedy = [GenerationRequest(prompts[i % len(prompts)] + (i,), 32, policy=POLICIES[i % 2], ignore_eos=True)
              for i in range(4)]
    return greedy + [GenerationRequest(prompts[1], 32, SamplingParams(temperature=0.9, seed=5), POLICIES[0],
                                       ignore_eos=True)]


def run(loop, workers, model_dirs, reqs):
    return generate_through(loop, workers, model_dirs.target, "async", reqs)


def test_a_draft_whose_step_always_raises_sheds_each_session_once(models, model_dirs, prompt_ids, loop, caplog):
    reqs = requests(prompt_ids)
    steps = [0]

    def broken_step(drafts):
        steps[0] += 1
        raise RuntimeError("a kernel that fails on every input")

    with in_process_workers(loop, models, load_aware="off") as w:
        w.draft.drafter.step = broken_step  # the fault, injected in the real service's step
        with caplog.at_level(logging.WARNING):
            results = run(loop, w, model_dirs, reqs)
        failed_steps = steps[0]
        again = run(loop, w, model_dirs, reqs[:1])  # a later session: one more failed step, shed, exact
    engine = SpeculativeEngine(models["target"], None)
    assert [r.token_ids for r in results[:-1]] == [engine.generate(r).token_ids for r in reqs[:-1]]
    assert len(results[-1].token_ids) == 32  # sampled: drawn by the target alone
    assert all(r.stats.detached == 1 and r.stats.reattached == 0 and r.stats.draft_tokens == 0 for r in results)
    assert 1 <= failed_steps <= len(reqs)  # each session's first step failed at most once: no retry loop
    assert steps[0] == failed_steps + 1 and again[0].token_ids == results[0].token_ids
    assert "shedding" in caplog.text


def test_a_draft_that_refuses_sessions_leaves_them_to_the_target_not_the_caller(models, model_dirs, prompt_ids, loop):
    """The draft's per-stream cap at 0: every start is refused with an error event. Before, a draft
    error ended the caller's request (a 500, or a 400 carrying the draft's message)."""
    reqs = requests(prompt_ids)
    with in_process_workers(loop, models, load_aware="off") as w:
        w.draft.max_sessions_per_stream = 0
        results = run(loop, w, model_dirs, reqs)
    engine = SpeculativeEngine(models["target"], None)
    assert [r.token_ids for r in results[:-1]] == [engine.generate(r).token_ids for r in reqs[:-1]]
    assert all(r.finish_reason == "length" and r.stats.detached == 1 and r.stats.draft_tokens == 0 for r in results)


def pipeline_session(models, prompt_ids) -> SessionPipeline:
    """A target-side session with a draft: the protocol's state machine, driven by hand (its
    effects go nowhere)."""
    limits = Limits(tokens=models["target"].token_limit, positions=512)
    return SessionPipeline("s", GenerationRequest(prompt_ids["short"], 8, policy=POLICIES[0]), frozenset(), limits,
                           Verifier(models["target"]).open(SamplingParams()), True, "async", 0.0)


@pytest.mark.parametrize("field, value", [("draft_s", float("nan")), ("started_at", float("inf")),
                                          ("finished_at", -1.0), ("prepared_base", 10**9)])
def test_a_draft_block_that_fails_the_checks_gives_the_draft_up_not_the_session(models, prompt_ids, field, value):
    """Timings not finite (a NaN once reached int(math.log(...)) and ended the session) or a
    prepared block far beyond the outstanding blocks (kept for ever): the draft is given up, the
    session goes on alone, no error reaches its caller."""
    session = pipeline_session(models, prompt_ids)
    block = DraftedBlock.empty(len(session.committed), session.epoch)
    block.block.tokens, block.block.entropies = [5], [0.5]
    if field == "prepared_base":
        block.prepared_for = (value, 0, 5)
    else:
        setattr(block, field, value)
    session.on_draft_event(1.0, block, 0.0, 10, True)  # raises nothing
    assert session.detached and session.draft_given_up and not session.ahead.prepared and not session.done
    session.attach(2.0)
    assert session.detached  # never taken up again


def test_a_reattach_after_a_stall_waits_a_doubling_backoff(models, prompt_ids):
    """Model-free but for the target's session: stall, try to re-attach at once (refused, wanted),
    re-attach after the backoff; the second stall waits twice as long."""
    session = pipeline_session(models, prompt_ids)
    session.verifying = None
    stalled_at = 100.0
    session.detach(stalled_at, True)
    assert session.reattach.not_before == stalled_at + REATTACH_BACKOFF_S
    session.attach(stalled_at)
    assert session.detached  # too soon
    session.retry_attach(stalled_at + 0.9 * REATTACH_BACKOFF_S)
    assert session.detached
    session.verifying = None
    session.retry_attach(stalled_at + 1.1 * REATTACH_BACKOFF_S)
    assert not session.detached and session.stats.reattached == 1
    session.verifying = None
    stalled_again = stalled_at + 2 * REATTACH_BACKOFF_S
    session.detach(stalled_again, True)
    assert session.reattach.not_before - stalled_again == 2 * REATTACH_BACKOFF_S
