"""Load-aware speculation keeps the output exact: whatever the cap a session's load calls for,
block after block (capped, paused, resumed), greedy output equals the target alone, in one
process and across the real workers (the target host pauses the draft, settles tokens alone, and
resumes it with them), sync and async.

The load is scripted here (the cost model's own numbers are tested in tests/unit/test_step_cost.py):
a schedule of caps per round, drawn from a seeded generator, with runs of 0 (pause) and of 1
(still paused: the gate resumes at 2) between ordinary caps."""

from __future__ import annotations

import random
import time

import pytest

from coordinator.engine import SpeculativeEngine
from draft_worker.drafter import Drafter
from draft_worker.pipelined import PipelinedDraft
from draft_worker.stepping import work
from svip_common.contracts import NO_TOKEN, Block, GenerationRequest, Limits, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.step_cost import PROBE_FIRST, PROBE_TOKENS, TargetLoad
from target_worker.verifier import Verifier
from tests.verdicts import apply_verdict
from tests.workers import assert_all_freed, generate_through, in_process_workers

HEAVY = TargetLoad(plain_rate=1000.0, verify_token_s=0.01)  # τ = 10: no token pays
LIGHT = TargetLoad(plain_rate=100.0, verify_token_s=0.0001)  # τ = 0.01: the policy decides
POLICIES = [PolicyConfig(name="svip", threshold=0.6), PolicyConfig(name="constant", draft_length=4)]


def schedule(seed: int):
    """Caps, round after round: runs of pauses between runs of ordinary caps."""
    rng = random.Random(seed)
    while True:
        for _ in range(rng.randint(1, 4)):
            yield rng.choice([0, 0, 1])
        for _ in range(rng.randint(1, 4)):
            yield rng.choice([2, 3, 8, 1 << 30])


def requests(prompt_ids, n: int = 6) -> list[GenerationRequest]:
    prompts = list(prompt_ids.values())
    return [GenerationRequest(prompts[i % len(prompts)] + (i,), 24 + 5 * i, policy=POLICIES[i % 2], ignore_eos=True)
            for i in range(n)]


def target_alone(models, reqs) -> list[list[int]]:
    engine = SpeculativeEngine(models["target"], None)
    return [engine.generate(r).token_ids for r in reqs]


def test_in_process_output_is_exact_through_pauses_and_caps(models, prompt_ids):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="all")
    loads = iter(HEAVY if i % 5 in (1, 2) else LIGHT for i in range(10**6))
    engine.verifier.load = lambda sessions=None: next(loads)
    reqs = requests(prompt_ids)
    alone = target_alone(models, reqs)
    results = engine.generate_many(reqs, batch_size=4)
    assert [r.token_ids for r in results] == alone
    assert sum(r.stats.pauses for r in results) > 0
    assert sum(r.stats.draft_tokens for r in results) > 0  # and drafting resumed
    assert [engine.generate(r).token_ids for r in reqs[:2]] == alone[:2]  # one at a time too


def test_a_heavily_loaded_batch_runs_as_the_target_alone(models, prompt_ids):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="all")
    engine.verifier.load = lambda sessions=None: HEAVY
    reqs = requests(prompt_ids, 4)
    results = engine.generate_many(reqs, batch_size=4)
    assert [r.token_ids for r in results] == target_alone(models, reqs)
    assert all(probes_only(r.stats) for r in results)


def probes_only(stats) -> bool:
    """A paused session drafts nothing but its probes: one block of PROBE_TOKENS every PROBE_FIRST
    or more paused rounds (svip_common/step_cost.py); its first round's block came before the pause."""
    blocks = [n for n in stats.draft_lengths[1:] if n]
    return all(n <= PROBE_TOKENS for n in blocks) and len(blocks) <= stats.rounds // PROBE_FIRST


def test_greedy_mode_leaves_sampled_requests_as_their_policy_drafts_them(models, prompt_ids):
    """The default mode: a greedy request pauses under heavy load, a sampled one keeps drafting,
    so its seed reproduces its output whatever the load."""
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="greedy")
    greedy, sampled = requests(prompt_ids, 2)
    sampled = GenerationRequest(sampled.prompt_ids, sampled.max_new_tokens, SamplingParams(temperature=0.8, seed=11),
                                sampled.policy, ignore_eos=True)
    light = engine.generate(sampled).token_ids
    engine.verifier.load = lambda sessions=None: HEAVY
    g, s = engine.generate_many([greedy, sampled], 2)
    assert probes_only(g.stats) and g.stats.pauses == 1 and g.token_ids == target_alone(models, [greedy])[0]
    assert s.stats.draft_tokens > 0 and s.stats.pauses == 0 and s.token_ids == light


@pytest.fixture(scope="module")
def workers(models, loop):
    """A real draft service and a real session host on loopback; the host's cap per round comes
    from the scripted schedule of the session's own seed."""
    with in_process_workers(loop, models, load_aware="all") as w:
        yield w


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_distributed_output_is_exact_through_pauses_and_resumes(workers, models, model_dirs, prompt_ids, loop,
                                                               pipeline):
    host, draft = workers.host, workers.draft
    caps = {}

    def scripted(gate):
        return next(caps.setdefault(id(gate), schedule(len(caps))))

    host.load_cap = scripted
    reqs = requests(prompt_ids)
    results = generate_through(loop, workers, model_dirs.target, pipeline, reqs)
    assert [r.token_ids for r in results] == target_alone(models, reqs)
    stats = [r.stats for r in results]
    assert sum(s.pauses for s in stats) > 0 and sum(s.round_sources.count("paused") for s in stats) > 0
    assert sum(s.draft_tokens for s in stats) > 0
    assert all(len(s.round_sources) == s.rounds for s in stats)
    assert_all_freed(host, draft, loop)


def test_a_session_that_starts_paused_runs_as_the_target_alone(workers, models, model_dirs, prompt_ids, loop):
    host = workers.host
    host.load_cap = lambda gate: 0
    reqs = requests(prompt_ids, 2)
    results = generate_through(loop, workers, model_dirs.target, "async", reqs)
    assert [r.token_ids for r in results] == target_alone(models, reqs)
    assert all(r.stats.draft_tokens == 0 and set(r.stats.round_sources) == {"paused"} for r in results)


def _paused_draft(models) -> PipelinedDraft:
    drafter = Drafter(models["close_draft"], models["target"].vocab_size)
    session = drafter.open(SamplingParams(), PolicyConfig(name="constant", draft_length=3), ())
    draft = PipelinedDraft(session, [5, 6, 7], 20, frozenset(), pipelined=False)
    assert draft.start(0.0, load_cap=0) == [] and draft.paused and draft.next_drafts(time.time()) == []
    return draft


def test_the_draft_checks_a_resume(models):
    draft = _paused_draft(models)
    with pytest.raises(InvalidRequest, match="resume at base 4"):
        draft.on_resume(time.time(), 1, 4, [9], 3, 0.0)
    with pytest.raises(InvalidRequest, match="past the session's 23 tokens"):
        draft.on_resume(time.time(), 1, 3, [9] * 21, 3, 0.0)
    with pytest.raises(InvalidRequest, match="load_cap 0"):
        draft.on_resume(time.time(), 1, 3, [9], 0, 0.0)
    draft.on_resume(time.time(), 1, 3, [9, 10], 2, 0.0)
    assert draft.known == [5, 6, 7, 9, 10] and not draft.paused
    while draft.critical is not None:
        work(draft, time.time())
    assert len(draft.outstanding[0].block) == 2  # the resumed cap
    with pytest.raises(InvalidRequest, match="not paused"):
        draft.on_resume(time.time(), 2, 5, [], 2, 0.0)


def test_sampled_sessions_pause_and_resume_without_a_protocol_error(workers, model_dirs, prompt_ids, loop):
    """Sampled: a rejection's correction may be drawn at the draft (its q stays there), so a pause
    waits for a verdict whose token the target settles; the session completes either way."""
    host, draft = workers.host, workers.draft
    caps = {}
    host.load_cap = lambda gate: next(caps.setdefault(id(gate), schedule(100 + len(caps))))
    reqs = [
        GenerationRequest(
            r.prompt_ids, r.max_new_tokens, SamplingParams(temperature=0.9, seed=3 + i), r.policy, ignore_eos=True
        )
        for i, r in enumerate(requests(prompt_ids))
    ]
    results = generate_through(loop, workers, model_dirs.target, "async", reqs)
    assert [len(r.token_ids) for r in results] == [r.max_new_tokens for r in reqs]
    assert sum(r.stats.pauses for r in results) > 0 and sum(r.stats.draft_tokens for r in results) > 0
    assert_all_freed(host, draft, loop)


def test_the_draft_refuses_a_pause_that_leaves_the_token_to_it(models):
    """A pause (load_cap 0) must come with the token the target settled: never a deferred verdict
    or a sampled correction the draft would draw, never a prepared block to verify next."""
    drafter = Drafter(models["close_draft"], models["target"].vocab_size)
    session = drafter.open(SamplingParams(), PolicyConfig(name="constant", draft_length=3), ())
    draft = PipelinedDraft(session, [5, 6, 7], 20, frozenset(), pipelined=False)
    draft.start(0.0)
    while draft.critical is not None:
        work(draft, time.time())
    sent = draft.outstanding[0].block
    with pytest.raises(InvalidRequest, match="must settle its token at the target"):
        apply_verdict(draft, time.time(), 0, sent.base, len(sent), 0, NO_TOKEN, None, False, 0.0, load_cap=0)


def test_the_target_refuses_a_block_while_the_session_is_paused(models):
    """A session that starts paused verifies alone; a draft block of its epoch is the draft's
    protocol error: the draft is given up for the session (never the caller's error)."""
    from coordinator.session.effects import ToDraft, Verify
    from coordinator.session.pipeline import SessionPipeline
    from svip_common.messages import DraftedBlock

    limits = Limits(tokens=models["target"].token_limit, positions=512)
    request = GenerationRequest((5, 6, 7), 8, policy=PolicyConfig(name="constant", draft_length=3))
    verifier = Verifier(models["target"], limits.tokens)
    session = SessionPipeline("s", request, frozenset(), limits, verifier.open(request.sampling), True, "async", 0.0,
                              load_cap=lambda gate: 0)
    effects = session.start(1.0, True)
    sent = [effect.request for effect in effects if isinstance(effect, ToDraft)]
    assert session.paused and sent[0].load_cap == 0 and any(isinstance(e, Verify) for e in effects)  # alone
    block = DraftedBlock.empty(3, session.epoch)
    block.block.tokens = [9]
    session.on_draft_event(2.0, block, 0.0, 0, True)  # a protocol error of the draft's: given up, the session goes on
    assert session.draft_given_up and session.detached and not session.done
    session.close(3.0)


def test_the_load_is_priced_on_decode_steps_and_the_batch_the_next_step_verifies(models, prompt_ids):
    """What the gate reads (Verifier.load): in process, a prompt's prefill never enters the fit
    the load is priced on (its hundreds of tokens, each cheaper, would set the slope a drafted
    row is priced at); steps of one token per session enter the plain fit too; the batch prices
    the load at the sessions its next step verifies, not at the average of steps before (a batch
    of 16 right after single requests would otherwise draft as if alone). Without a batch given
    (the distributed target) the fit over every step prices it, as before."""
    verifier = Verifier(models["target"], kv_cache_tokens=4096)
    session, committed = verifier.open(SamplingParams()), list(prompt_ids["long"])
    verifier.prefill_next([(session, committed)])  # the prompt, while idle
    assert verifier.decode_cost.steps == 0 and verifier.load(1) is None
    assert verifier.cost.steps == 1  # the fit over every step (the distributed target's price) has it

    def settle(drafted: list[int]) -> None:
        block = Block(base=len(committed), tokens=drafted, probs=[1.0] * len(drafted), entropies=[0.0] * len(drafted))
        verdict = session.verify(committed, block)
        committed.extend([*drafted[: verdict.accepted], verdict.token])

    settle([])  # the row the prefill stored settles it: no forward
    assert verifier.decode_cost.steps == 0
    settle([])  # one token: a plain step
    assert (verifier.decode_cost.steps, verifier.plain_cost.steps) == (1, 1)
    settle([5, 6])  # drafted rows: decode-shaped, not plain
    assert (verifier.decode_cost.steps, verifier.plain_cost.steps) == (2, 1)
    other = verifier.open(SamplingParams())
    verifier.verify_batch([(other, list(prompt_ids["short"]), Block(base=len(prompt_ids["short"]), tokens=[],
                                                                   probs=[], entropies=[]))])
    assert verifier.decode_cost.steps == 2 and verifier.cost.steps == 4  # a prompt in the step: not decode-shaped
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="greedy")
    seen, load = [], engine.verifier.load
    engine.verifier.load = lambda sessions=None: seen.append(sessions) or load(sessions)
    reqs = requests(prompt_ids, 4)
    engine.generate(reqs[0])
    assert set(seen) == {1}
    seen.clear()
    results = engine.generate_many(reqs, batch_size=4)
    assert 4 in seen and set(seen) <= {1, 2, 3, 4}  # the lockstep batch, as sessions finish
    assert [r.token_ids for r in results] == target_alone(models, reqs)

