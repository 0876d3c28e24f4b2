"""The target never waits idle for what it will need first: while no block is ready, it takes in
the last verdict's token (or a new prompt) of the sessions waiting on their drafts and stores the
row for the next place (``Verifier.prefill_next``, ``SessionHost(idle_prefill=...)``). A block
that arrives then has its first token judged at once and its forward holds its drafted tokens
only. Nothing is decided ahead: the rows are the ones the verification would compute, so the
output is the target's, token for token (greedy) and verdict for verdict (sampled, same seeds).

Verifier level: a block verified after a prefill gets the verdict it gets without one. Pipeline
level: real gRPC on loopback, the session host and a real draft service in this process, every
idle moment prefilled ("always"), never ("off"); the distributed tests run their Ray workers
with "always" too (tests/integration/test_distributed.py). When it pays: prefills_that_pay
(tests/unit/test_idle_prefills.py at several sessions)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from coordinator.engine import SpeculativeEngine
from coordinator.session.effects import Settle
from coordinator.session.pipeline import SessionPipeline
from draft_worker.drafter import Drafter
from svip_common.contracts import Block, GenerationRequest, Limits, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.knobs import knob
from svip_common.step_cost import SessionGate, StepCost, block_wait, early_row_gain, prefills_that_pay
from target_worker.verifier import Verifier
from tests.workers import generate_through, in_process_workers

PROMPT = [5, 17, 42, 8, 99, 23, 61, 7]


def _verdicts(models, sampling: SamplingParams, prefill: bool) -> list:
    """Three rounds of blocks for four sessions (rejections, full acceptances, a bonus), each
    round's blocks verified together; with prefill, every session's committed tokens that the
    cache lacks are taken in before each round, as an idle target would."""
    verifier = Verifier(models["target"], kv_cache_tokens=4096)
    sessions = [verifier.open(dataclasses.replace(sampling, seed=i)) for i in range(4)]
    committed = [list(PROMPT[: 4 + i]) for i in range(4)]
    vocab = models["target"].model.config.vocab_size
    q = None if sampling.greedy else torch.full((3, vocab), 1.0 / vocab)  # q here: the target draws corrections
    out = []
    for r in range(3):
        if prefill:
            assert verifier.prefill_next(list(zip(sessions, committed))) == 4
            assert not any(s.lacks_next_row(c) for s, c in zip(sessions, committed))
        jobs = [(s, c, Block(base=len(c), tokens=[(7 * i + r) % 50 + 1, 3, 9], probs=[0.4, 0.3, 0.5],
                             entropies=[0.1] * 3, q_rows=q)) for i, (s, c) in enumerate(zip(sessions, committed))]
        verdicts = verifier.verify_batch(jobs)
        for (_, c, block), v in zip(jobs, verdicts):
            assert v.token >= 0
            c += [*block.tokens[: v.accepted], v.token]
        out.append([(v.base, v.accepted, v.token) for v in verdicts])
    return out


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=30)],
                         ids=["greedy", "sampled"])
def test_a_block_after_a_prefill_gets_the_verdict_it_gets_without_one(models, sampling):
    assert _verdicts(models, sampling, prefill=True) == _verdicts(models, sampling, prefill=False)


def _ridden_verdicts(models, sampling: SamplingParams, ride: bool) -> list:
    """Four sessions in three rounds: in each, two verify blocks and the other two wait on their
    drafts (their rows ride the step, or nothing happens), then swap; the waiting ones' next
    blocks are judged against what was stored."""
    verifier = Verifier(models["target"], kv_cache_tokens=4096)
    sessions = [verifier.open(dataclasses.replace(sampling, seed=i)) for i in range(4)]
    committed = [list(PROMPT[: 4 + i]) for i in range(4)]
    verifier.prefill_next(list(zip(sessions, committed)))  # every prompt in: a rider's row is one token
    vocab = models["target"].model.config.vocab_size
    q = None if sampling.greedy else torch.full((2, vocab), 1.0 / vocab)  # q here: the target draws corrections
    out = []
    for r in range(6):
        turn = [i for i in range(4) if i % 2 == r % 2]
        riders = [(sessions[i], committed[i]) for i in range(4) if i not in turn] if ride else []
        jobs = [(sessions[i], committed[i], Block(base=len(committed[i]), tokens=[(7 * i + r) % 50 + 1, 3],
                                                  probs=[0.4, 0.3], entropies=[0.1] * 2, q_rows=q)) for i in turn]
        verdicts = verifier.verify_apart(jobs, riders=riders)
        for (_, c, block), v in zip(jobs, verdicts):
            c += [*block.tokens[: v.accepted], v.token]
        out.append([(v.base, v.accepted, v.token) for v in verdicts])
        if ride and sampling.greedy:  # a sampled session's last token waits for its block's step
            assert not any(s.lacks_next_row(c) for s, c in riders)
    return out


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=30)],
                         ids=["greedy", "sampled"])
def test_a_row_that_rode_a_verification_gives_the_verdicts_none_gives(models, sampling):
    """idle_work.py's riders: rows computed beside other sessions' blocks are the rows a
    verification would compute; the blocks judged after them get the verdicts they get without."""
    assert _ridden_verdicts(models, sampling, ride=True) == _ridden_verdicts(models, sampling, ride=False)


def test_the_targets_own_next_token_comes_from_a_row_stored_for_exactly_the_committed_tokens(models):
    """What a waiting greedy session settles alone (SessionPipeline.fill): the argmax of the row
    stored for exactly its committed tokens; nothing where the stored row is another sequence's
    (a block rejected at its last token leaves a row at the same place, on the drafted token)."""
    alone = SpeculativeEngine(models["target"], None).generate(GenerationRequest(PROMPT, 4)).token_ids
    verifier = Verifier(models["target"], kv_cache_tokens=4096)
    session = verifier.open(SamplingParams())
    committed = list(PROMPT)
    assert session.next_token(committed) is None  # no row stored yet
    verifier.prefill_next([(session, committed)])
    assert session.next_token(committed) == alone[0]
    wrong = (alone[1] + 1) % 50
    verdict = session.verify(committed, Block(base=len(committed), tokens=[alone[0], wrong], probs=[1, 1],
                                              entropies=[0, 0]))
    committed += [alone[0], verdict.token]
    assert (verdict.accepted, verdict.token) == (1, alone[1]) and session.next_token(committed) is None
    verifier.prefill_next([(session, committed)])
    assert session.next_token(committed) == alone[2]
    sampled = verifier.open(SamplingParams(temperature=0.8, seed=3))
    verifier.prefill_next([(sampled, list(PROMPT))])
    assert sampled.next_token(list(PROMPT)) is None  # a sampled session never settles alone


def test_a_prefill_takes_in_only_what_the_cache_lacks_and_then_nothing(models):
    verifier = Verifier(models["target"], kv_cache_tokens=4096)
    session = verifier.open(SamplingParams())
    committed = list(PROMPT)
    assert verifier.prefill_next([(session, committed)]) == 1 and verifier.pool.max_forward_tokens == len(PROMPT)
    assert verifier.prefill_next([(session, committed)]) == 0  # the row is stored: no forward
    verdict = session.verify(committed, Block(base=len(committed), tokens=[1, 2], probs=[0.5, 0.5], entropies=[0, 0]))
    committed += [1, 2][: verdict.accepted] + [verdict.token]
    forwards = session.forwards
    assert verifier.prefill_next([(session, committed)]) == 1 and session.forwards == forwards + 1
    assert verifier.last_step_tokens <= 2  # the verify step's, not the prefill's: unchanged


def test_a_long_prompt_is_prefilled_a_chunk_at_a_time_under_the_budget(models):
    verifier = Verifier(models["target"], kv_cache_tokens=4096)
    session = verifier.open(SamplingParams())
    prompt = list(range(3, 40))
    steps = 0
    while session.lacks_next_row(prompt):
        assert verifier.prefill_next([(session, prompt)], budget=10) == 1
        steps += 1
    assert steps == 4 and verifier.pool.max_forward_tokens == 10 and session.cached_tokens == len(prompt)


def test_when_a_prefill_pays():
    """It pays where the block takes longer to come than a one-token forward (a CPU's drafting),
    or nearly so with rejections common; not where the draft answers at once (a GPU's)."""
    cpu, gpu = StepCost(), StepCost()
    for tokens in (1, 3, 5) * 10:
        cpu.observe(tokens, 0.008 + 0.0005 * tokens)
        gpu.observe(tokens, 0.007 + 0.00005 * tokens)
    slow_draft, fast_draft = SessionGate(), SessionGate()
    for gate, draft_s, round_s in ((slow_draft, 0.0026, 0.003), (fast_draft, 0.0001, 0.0003)):
        for _ in range(20):
            gate.record(3, 2, draft_s * 3)
            gate.record_round_trip(round_s)

    def pays(gate: SessionGate, verify: StepCost) -> bool:  # a lone session, its verdict just out
        return prefills_that_pay([(1, early_row_gain(gate, verify))], [block_wait(gate, 0.0)], verify) == [0]

    assert pays(slow_draft, cpu) and not pays(fast_draft, gpu)
    assert not pays(slow_draft, StepCost())  # nothing measured yet
    with pytest.raises(InvalidRequest, match="idle_prefill must be one of auto, always, off"):
        knob("idle_prefill").check("sometimes")


@pytest.mark.parametrize("idle_prefill", ["always", "off"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_pipeline_through_idle_prefills_equals_the_target_alone(models, model_dirs, prompt_ids, loop,
                                                                     idle_prefill, mode):
    svip = PolicyConfig(name="svip", threshold=0.4)
    requests = [GenerationRequest(ids, 32, policy=svip) for ids in prompt_ids.values()]
    requests += [GenerationRequest(prompt_ids["medium"], 24, policy=PolicyConfig(name="constant", draft_length=4))]
    alone = SpeculativeEngine(models["target"], None)
    with in_process_workers(loop, models, load_aware="off", idle_prefill=idle_prefill) as w:
        results = generate_through(loop, w, model_dirs.target, mode, requests)
        prefills = w.host.idle_work.prefills
    for request, result in zip(requests, results):
        assert result.token_ids == alone.generate(request).token_ids
    assert (prefills > len(requests)) if idle_prefill == "always" else prefills == 0  # more than the prompts


def test_auto_prefills_a_lone_sessions_prompt_and_equals_the_target_alone(models, model_dirs, prompt_ids, loop):
    """auto, one session on the host: its prompt goes in while the draft prefills its own (the
    tokens after it where the measured costs say it pays); the output is the target's."""
    request = GenerationRequest(prompt_ids["long"], 32, policy=PolicyConfig(name="svip", threshold=0.4))
    with in_process_workers(loop, models, load_aware="off") as w:
        assert w.host.idle_work.mode == "auto"
        [result] = generate_through(loop, w, model_dirs.target, "sync", [request])
        assert w.host.idle_work.prefills >= 1
    assert result.token_ids == SpeculativeEngine(models["target"], None).generate(request).token_ids


class HeldDrafter(Drafter):
    """A draft whose first forward waits until the target has settled a token of its own: a gate,
    so every run has a block that comes after the target's own tokens (not a matter of speed)."""

    def __init__(self, *args, released: threading.Event, **kwargs):
        super().__init__(*args, **kwargs)
        self.released = released

    def step(self, drafts) -> None:
        if not self.released.wait(120):
            raise RuntimeError("the target settled no token of its own while the draft waited")
        super().step(drafts)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_blocks_checked_against_the_targets_own_tokens_equal_the_target_alone(models, model_dirs, prompt_ids, loop,
                                                                              monkeypatch, mode):
    """The target never idles for a block: while a greedy session waits on its draft the target
    settles its own next tokens (``idle_prefill`` "always": every idle moment), and each block is
    checked against them when it comes, the rest verified after them. The draft's first forward
    is held until the target has settled a token alone, so blocks come late by construction; the
    output is the target's, token for token. From then on the target waits for the blocks (idle
    work off), so that the draft's blocks count by construction too, however slow the draft runs
    beside the target here (with every idle moment filled, a run under load once settled every
    token alone)."""
    released = threading.Event()
    fill = SessionPipeline.fill
    idle_work = []  # the host's, once the workers are up

    def releasing_fill(self, now, started, ended):
        effects = fill(self, now, started, ended)
        if any(isinstance(effect, Settle) for effect in effects):
            idle_work[0].mode = "off"  # this is its compute thread: the next idle moment reads it
            released.set()
        return effects

    monkeypatch.setattr(SessionPipeline, "fill", releasing_fill)
    limits = Limits(tokens=models["target"].token_limit, positions=512)
    drafter = HeldDrafter(models["close_draft"], models["target"].vocab_size, limits.tokens, released=released)
    svip = PolicyConfig(name="svip", threshold=0.4)
    requests = [GenerationRequest(ids, 32, policy=svip) for ids in prompt_ids.values()]
    alone = SpeculativeEngine(models["target"], None)
    with in_process_workers(loop, models, drafter=drafter, load_aware="off", idle_prefill="always") as w:
        idle_work.append(w.host.idle_work)
        results = generate_through(loop, w, model_dirs.target, mode, requests)
    # read once the host has closed: its compute thread counts a fill after the fill's token, which
    # may be a request's last, has gone to the caller
    fills, verified = w.host.idle_work.fills, w.host.verifier.tokens_verified
    for request, result in zip(requests, results):
        assert result.token_ids == alone.generate(request).token_ids
    sources = [source for result in results for source in result.stats.round_sources]
    assert fills >= 1 and sources.count("filled") == fills
    # every drafted token of a current block is judged once: by the verifier, or against the target's own
    assert verified == sum(sum(result.stats.draft_lengths) for result in results)
    assert sum(result.stats.accepted_tokens for result in results) > 0  # the draft's blocks still count
