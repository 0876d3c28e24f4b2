"""The distributed protocol through the in-memory transport (coordinator/in_memory.py): the real
session host and draft service, the real verifier and drafter, every message through the wire
and back, in one thread, with the interleaving chosen by a schedule. Greedy output equals the
target alone in sync and async mode, for every policy, under orders that favour either worker and
under random interleavings; seeded sampling reproduces and equals the gRPC workers'; forced
interleavings (a follow-up arriving mid-verify, a draft that never answers, a lost draft) keep
the output exact."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.engine import SpeculativeEngine
from coordinator.in_memory import DELIVERIES, STEPS, WORK, InMemoryPair, InOrder, Seeded
from draft_worker.drafter import Drafter
from svip_common.arrivals import BlockArrivals
from svip_common.contracts import GenerationRequest, Limits, PolicyConfig, SamplingParams
from svip_common.kv_sizes import DEFAULT_KV_TOKENS
from svip_proto import svip_pb2 as pb
from target_worker.verifier import Verifier
from tests.integration.test_sampling_exact import ALPHA, chi_square_pvalue, exact_marginals
from tests.policies import POLICIES

MAX_NEW = 32
DRAFT_FIRST = InOrder((*DELIVERIES, *WORK, "draft_idle", "target_idle"), during=True)  # the draft always early
TARGET_FIRST = InOrder()  # the target verifies before the draft works ahead


def make_pair(models, pipeline="async", schedule=None, draft="close_draft", target_kv_tokens=DEFAULT_KV_TOKENS,
              **host_options) -> InMemoryPair:
    limits = Limits(tokens=models["target"].token_limit, positions=512)
    drafter = None if draft is None else Drafter(models[draft], models["target"].vocab_size, limits.tokens)
    options = {"load_aware": "off", "idle_prefill": "always", **host_options}
    verifier = Verifier(models["target"], limits.tokens, target_kv_tokens)
    return InMemoryPair(models["target"], verifier, drafter, limits, pipeline, schedule, **options)


@pytest.fixture(scope="module")
def alone(models):
    return SpeculativeEngine(models["target"], None)


@pytest.mark.parametrize("pipeline", ["sync", "async"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("schedule", ["target first", "draft first"])
def test_greedy_equals_the_target_alone(models, prompt_ids, alone, pipeline, policy, schedule):
    pair = make_pair(models, pipeline, TARGET_FIRST if schedule == "target first" else DRAFT_FIRST)
    for name, ids in prompt_ids.items():
        request = GenerationRequest(ids, MAX_NEW, policy=POLICIES[policy])
        result = pair.generate(request)
        assert result.token_ids == alone.generate(request).token_ids, (pipeline, policy, schedule, name)
        assert result.finish_reason == "length"


@pytest.mark.parametrize("seed", range(6))
def test_greedy_is_exact_under_random_interleavings_of_many_sessions(models, prompt_ids, alone, seed):
    pair = make_pair(models, "async" if seed % 2 else "sync", Seeded(seed), load_aware="greedy",
                     idle_prefill="auto" if seed % 3 else "always")
    prompts = list(prompt_ids.values())
    requests = [GenerationRequest(prompts[i % len(prompts)], 12 + 5 * i, policy=list(POLICIES.values())[i % 5])
                for i in range(6)]
    for request, result in zip(requests, pair.generate_all(requests)):
        assert result.token_ids == alone.generate(request).token_ids


def test_greedy_is_exact_drafting_one_block_at_a_time(models, prompt_ids, alone):
    """A draft worker without side-by-side blocks (parallel 1: no forks, as a feature head): its
    follow-ups stop where continuations wait for the one place (stepping.py ``_extends``); greedy
    output still equals the target alone's with the draft early, late and under random
    interleavings, and continuations prepared one at a time are used."""
    prompts = list(prompt_ids.values())
    requests = [GenerationRequest(prompts[i % len(prompts)], 16 + 4 * i, policy=list(POLICIES.values())[i % 5])
                for i in range(5)]
    used = 0
    for schedule in (DRAFT_FIRST, TARGET_FIRST, Seeded(0), Seeded(1)):
        results = make_pair(models, "async", schedule, parallel=1).generate_all(requests)
        for request, result in zip(requests, results):
            assert result.token_ids == alone.generate(request).token_ids, schedule
        used += sum(r.stats.prepared_used for r in results)
    assert used > 0


def test_schedules_reach_the_async_protocols_paths(models, prompt_ids):
    """What the forced orders are for: with the draft always early, follow-ups are verified with
    no round trip and prepared continuations are used; with random interleavings, blocks drafted
    on a rolled-back line are discarded unverified."""
    request = GenerationRequest(prompt_ids["long"], 48, policy=POLICIES["svip"])
    early = make_pair(models, "async", DRAFT_FIRST).generate(request).stats
    sources = set(early.round_sources)
    assert {"followup", "prepared"} <= sources, sources
    discarded = sum(make_pair(models, "async", Seeded(seed)).generate(request).stats.discarded_tokens
                    for seed in range(4))
    assert discarded > 0
    waits = make_pair(models, "sync", TARGET_FIRST)  # the target idles while the draft drafts: it prefills, fills
    stats = waits.generate(request).stats
    assert waits.host.idle_work.prefills > 0 and waits.host.idle_work.fills > 0 and "filled" in stats.round_sources


def test_seeded_sampling_reproduces_across_interleavings(models, prompt_ids):
    """Every draw is keyed by its position: the same seed gives the same tokens however the two
    workers' steps interleave (a sampled session never settles a token by timing)."""
    request = GenerationRequest(prompt_ids["medium"], MAX_NEW, SamplingParams(temperature=0.9, top_p=0.95, seed=7),
                                POLICIES["svip"])
    outputs = {tuple(make_pair(models, "async", schedule).generate(request).token_ids)
               for schedule in (TARGET_FIRST, DRAFT_FIRST, Seeded(1), Seeded(2))}
    assert len(outputs) == 1


def test_a_follow_up_arriving_mid_verify_is_held_and_verified_next(models, prompt_ids, alone):
    """The draft's follow-up reaches the target during the forward on the block before it: it is
    held, and on a full acceptance verified next without a round trip."""
    pair = make_pair(models, "async", DRAFT_FIRST, draft="target")  # a draft equal to its target: all accepted
    request = GenerationRequest(prompt_ids["medium"], MAX_NEW, policy=POLICIES["constant"])
    result = pair.generate(request)
    assert result.token_ids == alone.generate(request).token_ids
    assert result.stats.round_sources.count("followup") >= 3


def test_a_draft_that_never_answers_is_left_behind_at_the_stall_deadline(models, prompt_ids, alone):
    """Nothing the draft sends arrives; at a clock past the stall deadline the host's check
    detaches the session and the target finishes it alone, exactly. (The target settles no
    tokens of its own while it waits: idle_prefill off.)"""
    now = [1000.0]
    pair = make_pair(models, "async", InOrder(), clock=lambda: now[0], idle_prefill="off")
    request = GenerationRequest(prompt_ids["short"], MAX_NEW, policy=POLICIES["svip"])
    pending = pair.submit(request)
    while pair.step() is not None:
        pair.wires["to_target"].in_flight.clear()  # the draft's blocks are lost on the way
    assert not pending.done and pair.host.sessions  # it waits on its draft
    now[0] += pair.host.draft.stall_deadline() + 1
    pair.check()
    pair.run()
    result = pending.result()
    assert result.token_ids == alone.generate(request).token_ids
    assert result.stats.detached == 1


@pytest.mark.parametrize("sampled", [False, True])
def test_a_lost_draft_mid_session_then_back_keeps_the_output(models, prompt_ids, alone, sampled):
    sampling = SamplingParams(temperature=0.8, seed=3) if sampled else SamplingParams()
    request = GenerationRequest(prompt_ids["long"], MAX_NEW, sampling, POLICIES["svip"])
    reference = make_pair(models, "async", TARGET_FIRST).generate(request).token_ids
    pair = make_pair(models, "async", TARGET_FIRST)
    pending = pair.submit(request)
    for _ in range(40):
        pair.step()
    pair.lose_draft()
    for _ in range(20):
        pair.step()
    pair.draft_back()
    pair.run()
    result = pending.result()
    assert result.token_ids == reference
    if not sampled:
        assert result.token_ids == alone.generate(request).token_ids
    assert result.stats.detached == 1 and result.stats.reattached == 1


def test_the_target_alone_through_the_transport(models, prompt_ids, alone):
    pair = make_pair(models, "sync", draft=None)
    request = GenerationRequest(prompt_ids["medium"], MAX_NEW, policy=POLICIES["none"])
    assert pair.generate(request).token_ids == alone.generate(request).token_ids


def test_every_step_crosses_the_wire_contract(models, prompt_ids):
    """What the schedule sees is the real traffic: both directions carry serialised messages."""
    pair = make_pair(models, "async", TARGET_FIRST)
    pair.submit(GenerationRequest(prompt_ids["short"], 8, policy=POLICIES["svip"]))
    seen = set()
    while (action := pair.step()) is not None:
        seen.add(action)
    assert set(DELIVERIES) | set(WORK) <= seen and set(STEPS) & seen


PLAIN, WARPED = SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=40, top_p=0.9)


@pytest.mark.parametrize("pipeline, sampling", [
    ("async", PLAIN), ("sync", WARPED),
    pytest.param("sync", PLAIN, marks=pytest.mark.system), pytest.param("async", WARPED, marks=pytest.mark.system),
], ids=["plain-async", "warped-sync", "plain-sync", "warped-async"])
def test_the_sampling_distribution_under_random_interleavings(models, prompt_ids, pipeline, sampling):
    """The first two tokens of 1,500 seeded requests, 50 in flight at a time, their steps
    interleaved at random: they follow the target's exact marginals and are told apart from the
    draft's. Warped, a rejection's p row crosses the wire by its ids with mass (p_nonzero)."""
    pair = make_pair(models, pipeline, Seeded(len(pipeline) + int(sampling.top_p * 10)))
    results = _first_two_follow_the_target(pair, models, prompt_ids["medium"], sampling, tokens=3)
    rejections = sum(a < d for r in results for a, d in zip(r.stats.accepted_lengths, r.stats.draft_lengths))
    assert rejections > 0
    if sampling.top_p < 1.0:
        row = models["target"].vocab_size * 4  # a whole float32 p row
        assert sum(r.stats.wire_bytes for r in results) < rejections * row / 2  # rows by ids


def _first_two_follow_the_target(pair, models, prompt, sampling, tokens: int) -> list:
    """1,500 seeded requests of ``tokens`` tokens, 50 in flight at a time, through the pair: their
    first two tokens follow the target's exact marginals and are told apart from the draft's.
    Their results."""
    requests = [GenerationRequest(prompt, tokens, dataclasses.replace(sampling, seed=s), POLICIES["constant"])
                for s in range(1500)]
    results = [r for i in range(0, len(requests), 50) for r in pair.generate_all(requests[i:i + 50])]
    firsts, seconds = [r.token_ids[0] for r in results], [r.token_ids[1] for r in results]
    p1, p2 = exact_marginals(models["target"].model, prompt, sampling)
    assert chi_square_pvalue(firsts, p1) > ALPHA and chi_square_pvalue(seconds, p2) > ALPHA
    q1, q2 = exact_marginals(models["close_draft"].model, prompt, sampling)
    assert chi_square_pvalue(firsts, q1) < ALPHA or chi_square_pvalue(seconds, q2) < ALPHA
    return results


@pytest.mark.parametrize("pipeline, seed", [("sync", 0), ("async", 1)])
def test_a_pool_short_of_pages_preempts_the_newest_session_and_every_output_stays_exact(
        models, prompt_ids, alone, pipeline, seed):
    """Admission by use (issue 40): five sessions of up to 96 tokens (6 pages each) start together
    (every start is delivered before any step) on a pool of 160 tokens (10 pages), so pages run
    short as they grow: the newest gives its pages back and waits, and is recomputed from its
    committed tokens once there is room, under random interleavings. Every greedy output equals the
    target alone's; in sync mode every output, the seeded sampled one too, equals the same
    requests' on a pool that never runs short (the resumed path keeps what a seed draws)."""
    prompts = [prompt_ids["short"], prompt_ids["medium"]]
    constant = PolicyConfig(name="constant", draft_length=4)
    requests = [GenerationRequest(prompts[i % 2] + (i,), 80, policy=constant, ignore_eos=True) for i in range(4)]
    requests.append(GenerationRequest(prompts[1], 80, SamplingParams(temperature=0.9, seed=9), constant,
                                      ignore_eos=True))
    pair = make_pair(models, pipeline, Seeded(seed), target_kv_tokens=160)
    results = pair.generate_all(requests)
    pool = pair.host.verifier.pool
    assert pair.host.pages.preemptions >= 1
    assert pool.free_pages == pool.pages and not pair.host.pages.waiting
    assert [r.token_ids for r in results[:4]] == [alone.generate(r).token_ids for r in requests[:4]]
    assert all(len(r.token_ids) == 80 for r in results)
    if pipeline == "sync":
        roomy = make_pair(models, pipeline, Seeded(seed))
        assert [r.token_ids for r in roomy.generate_all(requests)] == [r.token_ids for r in results]
        assert roomy.host.pages.preemptions == 0


def test_a_session_as_large_as_the_pool_takes_its_turn_once_alone(models, prompt_ids, alone):
    """A session whose prompt nearly fills the pool starts while another holds pages, so it waits;
    once alone it must take its turn even where its need and the watermark together pass the pool
    (else it would wait for ever: admission allows a session as large as the pool)."""
    constant = PolicyConfig(name="constant", draft_length=4)
    first = GenerationRequest(prompt_ids["medium"], 40, policy=constant, ignore_eos=True)
    long_prompt = (prompt_ids["long"] * 8)[:241]  # 241 + 15 = 256: the whole pool of 16 pages
    large = GenerationRequest(long_prompt, 15, policy=constant, ignore_eos=True)
    pair = make_pair(models, "sync", target_kv_tokens=256)
    held = pair.submit(first)
    while not any(s.target.cached_tokens for s in pair.host.sessions.values()):  # the first's prefill
        assert pair.step() is not None
    waiting = pair.submit(large)
    while not pair.host.pages.waiting:
        assert pair.step() is not None
    assert not held.done
    pair.run()
    expected = [alone.generate(r).token_ids for r in (first, large)]
    assert [held.result().token_ids, waiting.result().token_ids] == expected


def test_the_target_admits_by_use_and_refuses_only_a_session_its_pool_cannot_hold_at_all(models, prompt_ids, alone):
    """Three sessions of up to 112 tokens each on a 256-token pool: all three start together (pages
    are taken as a session grows, issue 40; before, the third was refused while the two held their
    worst case), and where pages run short the newest yields and is recomputed: every output
    exact. A session larger than the whole pool is refused as overloaded (RESOURCE_EXHAUSTED on the
    wire), and only it."""
    from svip_common.errors import Overloaded

    constant = PolicyConfig(name="constant", draft_length=4)
    prompt = prompt_ids["medium"][:12]
    requests = [GenerationRequest(prompt + (i,), 99, policy=constant, ignore_eos=True) for i in range(3)]
    pair = make_pair(models, "async", Seeded(3), target_kv_tokens=256)
    running = [pair.submit(r) for r in requests]
    too_large = pair.submit(GenerationRequest(prompt, 256, policy=constant, ignore_eos=True))
    together = 0
    while not all(p.done for p in (*running, too_large)):
        assert pair.step() is not None
        together = max(together, len(pair.host.sessions))
    assert together == 3
    with pytest.raises(Overloaded, match="KV pool holds 256 tokens; this session needs"):
        too_large.result()
    assert [p.result().token_ids for p in running] == [alone.generate(r).token_ids for r in requests]


@pytest.mark.parametrize("room", [0, 16])
def test_a_draft_pool_short_of_room_for_forks_takes_them_back_before_any_session(models, prompt_ids, alone, room):
    """Prepared continuations drafted side by side hold forks of their session's cache: when the
    draft's pool runs short, the forks go back (their blocks still serve) and no session is shed."""
    limits = Limits(tokens=models["target"].token_limit, positions=512)
    longest = max(map(len, prompt_ids.values())) + MAX_NEW + 16  # a session and its block, a page to spare
    drafter = Drafter(models["close_draft"], models["target"].vocab_size, limits.tokens, kv_cache_tokens=longest + room)
    pair = InMemoryPair(models["target"], Verifier(models["target"], limits.tokens), drafter, limits, "async",
                        DRAFT_FIRST, parallel=3, load_aware="off", idle_prefill="always")
    for ids in prompt_ids.values():
        request = GenerationRequest(ids, MAX_NEW, policy=POLICIES["svip"])
        assert pair.generate(request).token_ids == alone.generate(request).token_ids
    assert pair.draft.forks_released > 0 and pair.draft.shed == 0
    stats = pb.WorkerStats()
    pair.draft.add_stats(stats)  # what the draft's Stats answers, and Prometheus counts up
    assert (stats.forks_released, stats.sessions_shed) == (pair.draft.forks_released, 0)


@pytest.mark.parametrize("prepare", [0, 2])
def test_the_draft_worker_counts_the_tokens_it_drafts_for_prepared_continuations(models, prompt_ids, alone, prepare,
                                                                                  monkeypatch):
    """Issue 60's cost of preparing: WorkerStats.prepared_tokens (Prometheus' draft_prepared_tokens)
    counts the tokens drafted for continuations prepared after a rejection; none when the worker
    prepares none, and the outputs are the target's either way. The draft always has room before a
    verdict and a row is free (both read this machine's clock otherwise): what it prepares is the
    schedule's alone."""
    from draft_worker import service
    from draft_worker.line_state import VerdictTiming

    monkeypatch.setattr(VerdictTiming, "room_for_a_forward", lambda timing, now, outstanding: True)
    monkeypatch.setattr(service, "row_share", lambda cost: 0.0)
    limits = Limits(tokens=models["target"].token_limit, positions=512)
    drafter = Drafter(models["close_draft"], models["target"].vocab_size, limits.tokens)
    pair = InMemoryPair(models["target"], Verifier(models["target"], limits.tokens), drafter, limits, "async",
                        DRAFT_FIRST, prepare=prepare, load_aware="off")
    for ids in prompt_ids.values():
        request = GenerationRequest(ids, MAX_NEW, policy=POLICIES["svip"])
        assert pair.generate(request).token_ids == alone.generate(request).token_ids
    assert (pair.draft.prepared_tokens > 0) == (prepare > 0)
    stats = pb.WorkerStats()
    pair.draft.add_stats(stats)
    assert stats.prepared_tokens == pair.draft.prepared_tokens


def test_a_half_drafted_continuation_taken_up_keeps_the_output_the_targets(models, prompt_ids, alone, monkeypatch):
    """Issue 60: under random interleavings rejections come while their continuations are still
    being drafted; those taken up as the next block (Job.take_up) leave every output the target
    alone's. The draft always has room before a verdict (VerdictTiming reads this machine's clock
    here): which continuations are in the making at a verdict is the schedule's alone."""
    from draft_worker.line_state import Job, VerdictTiming

    monkeypatch.setattr(VerdictTiming, "room_for_a_forward", lambda timing, now, outstanding: True)
    taken = []
    take_up = Job.take_up
    monkeypatch.setattr(Job, "take_up", lambda job, session, resolved: taken.append(job) or take_up(job, session,
                                                                                                      resolved))
    for seed in range(4):
        for policy in ("svip", "heuristic", "auto"):
            request = GenerationRequest(prompt_ids["long"], 48, policy=POLICIES[policy])
            assert make_pair(models, "async", Seeded(seed)).generate(request).token_ids == \
                alone.generate(request).token_ids, (seed, policy)
    assert taken, "no rejection found its continuation half drafted"


@pytest.mark.parametrize("seed", range(3))
def test_rows_that_ride_and_follow_ups_that_grow_keep_every_output_the_targets(models, prompt_ids, alone, seed,
                                                                              monkeypatch):
    """Issue 60, at several sessions: the rows of sessions waiting on their drafts ride other
    sessions' verification steps (idle_work.py, riders), and a follow-up leaves at its first stop
    and grows at the target until it is verified (growth.py), its growths taken in as the
    schedule delivers them (one too late for its verdict: test_session_pipeline.py). Every greedy
    output is the target alone's, and both happen. Nothing reads this machine's clock or its step
    times: the draft always has room before a verdict (in place of VerdictTiming), and a row costs
    it nothing (priced by the draft's timed steps, the prepared rows left some seeds with no
    session waiting to ride); every waiting session rides (make_pair's idle_prefill "always")."""
    import draft_worker.service as service_module
    from coordinator.session.ahead import AheadBlocks
    from draft_worker.line_state import VerdictTiming

    monkeypatch.setattr(VerdictTiming, "room_for_a_forward", lambda timing, now, outstanding: True)
    monkeypatch.setattr(service_module, "row_share", lambda cost: 0.0)
    grown = []
    grow = AheadBlocks.grow
    monkeypatch.setattr(AheadBlocks, "grow", lambda ahead, more: grown.append(grow(ahead, more)) or grown[-1])
    pair = make_pair(models, "async", Seeded(seed))
    prompts = list(prompt_ids.values())
    requests = [GenerationRequest(prompts[i % len(prompts)], 24 + 6 * i, policy=list(POLICIES.values())[i % 3])
                for i in range(4)]
    for request, result in zip(requests, pair.generate_all(requests)):
        assert result.token_ids == alone.generate(request).token_ids
    assert pair.host.idle_work.rides > 0 and any(grown), (pair.host.idle_work.rides, grown)


def test_prepared_continuations_sent_before_they_end_keep_every_output_the_targets(models, prompt_ids, alone,
                                                                                   monkeypatch):
    """Issue 60, at several sessions (stepping.py ``_sent_now``, pipelined.py ``_take_sent``): a
    prepared continuation drafting on past its stop is sent as it stands, its rest as a growth,
    and a verdict that uses it verifies it as the target holds it, what the draft drafted past
    that going on as the next follow-up. Under random interleavings every greedy output is the
    target alone's, and verdicts use such continuations. Nothing reads this machine's clock: a
    block drafts past its stop for at most three tokens (in place of VerdictTiming), a row costs
    nothing, and every continuation drafting on past its stop is sent at once (its verdict is
    always near: the margin's forwards made unbounded)."""
    import draft_worker.service as service_module
    import draft_worker.stepping as stepping_module
    from draft_worker.pipelined import PipelinedDraft
    from draft_worker.stepping import Stepping

    monkeypatch.setattr(service_module, "row_share", lambda cost: 0.0)
    monkeypatch.setattr(Stepping, "_extends", lambda draft, job: job is not draft.critical and bool(
        draft.outstanding) and job.draft.extended < 3)
    monkeypatch.setattr(stepping_module, "EARLY_FORWARDS", 1e9)
    taken = []
    take_sent = PipelinedDraft._take_sent
    monkeypatch.setattr(PipelinedDraft, "_take_sent", lambda draft, *args: taken.append(args[4]) or take_sent(
        draft, *args))
    prompts = list(prompt_ids.values())
    requests = [GenerationRequest(prompts[i % len(prompts)], 32 + 4 * i, policy=POLICIES["svip"]) for i in range(4)]
    for seed in range(3):
        pair = make_pair(models, "async", Seeded(seed))
        for request, result in zip(requests, pair.generate_all(requests)):
            assert result.token_ids == alone.generate(request).token_ids and not result.stats.detached, seed
    assert taken, "no verdict used a continuation sent before it ended"


def test_flat_trees_grow_at_the_target_and_send_continuations_early_keeping_every_output(
        models, prompt_ids, alone, monkeypatch):
    """Issue 60, trees at several sessions: a flat tree's follow-up leaves at its first stop and
    grows at the target, its growths carrying their places' siblings (growth.py, AheadBlocks.grow),
    and a tree continuation drafting on past its stop is sent as it stands (stepping.py
    ``_sent_now``), as a chain's do. Under random interleavings every greedy output is the target
    alone's, no session goes on without its draft, growths with siblings reach the target in time,
    and verdicts use continuations sent early; a deep tree's session beside them never grows (its
    draft is never given up). Nothing reads this machine's clock: a block drafts past its stop for
    at most three tokens, a row costs nothing, and a continuation past its stop is sent at once."""
    import draft_worker.service as service_module
    import draft_worker.stepping as stepping_module
    from coordinator.session.ahead import AheadBlocks
    from draft_worker.pipelined import PipelinedDraft
    from draft_worker.stepping import Stepping
    from tests.policies import TREE_POLICIES

    monkeypatch.setattr(service_module, "row_share", lambda cost: 0.0)
    monkeypatch.setattr(Stepping, "_extends", lambda draft, job: job is not draft.critical and bool(
        draft.outstanding) and job.draft.extended < 3)
    monkeypatch.setattr(stepping_module, "EARLY_FORWARDS", 1e9)
    grown, taken = [], []
    grow = AheadBlocks.grow
    monkeypatch.setattr(AheadBlocks, "grow", lambda ahead, more: grown.append(
        (grow(ahead, more), more.block.siblings is not None)) or grown[-1][0])
    take_sent = PipelinedDraft._take_sent
    monkeypatch.setattr(PipelinedDraft, "_take_sent", lambda draft, *args: taken.append(args[0]) or take_sent(
        draft, *args))
    prompts = list(prompt_ids.values())
    # and a deep tree beside them, which never grows (the target would give its draft up: detached)
    policies = [TREE_POLICIES[name] for name in ("svip-cape", "svip-auto", "constant-cape", "svip-deep")]
    requests = [GenerationRequest(prompts[i % len(prompts)], 32 + 4 * i, policy=policies[i]) for i in range(4)]
    for seed in range(3):
        pair = make_pair(models, "async", Seeded(seed))
        for request, result in zip(requests, pair.generate_all(requests)):
            assert result.token_ids == alone.generate(request).token_ids and not result.stats.detached, seed
    assert (True, True) in grown, "no growth with siblings reached the target in time"
    assert taken, "no verdict used a tree continuation sent before it ended"


def test_what_a_follow_up_drafted_past_the_targets_cut_goes_on_as_the_next_and_keeps_every_output(
        models, prompt_ids, alone, monkeypatch):
    """Issue 60 (growth.py): the target verifies a growing follow-up as it holds it when the block
    before it is accepted whole; what the draft drafted past that cut (its growths in flight, or
    the rest of a follow-up that stopped growing) goes on as the next follow-up, sent at once and
    grown on, not drafted again. Under random interleavings every greedy output is the target
    alone's, no session goes on without its draft, and it happens. The target's own weights draft
    (every block accepted whole: follow-ups all the way), and a block drafts past its stop for at
    most three tokens (in place of VerdictTiming, which reads this machine's clock), so that
    follow-ups are still growing when their cuts come; a row costs nothing (its price is learnt
    from this machine's steps), so such a block rides every step."""
    import draft_worker.service as service_module
    from draft_worker.line_state import VerdictTiming
    from draft_worker.pipelined import PipelinedDraft
    from draft_worker.stepping import Stepping

    monkeypatch.setattr(VerdictTiming, "room_for_a_forward", lambda timing, now, outstanding: True)
    monkeypatch.setattr(service_module, "row_share", lambda cost: 0.0)
    monkeypatch.setattr(Stepping, "_extends", lambda draft, job: job is not draft.critical and bool(
        draft.outstanding) and job.draft.extended < 3)
    cut = []
    follow_the_cut = PipelinedDraft._follow_the_cut
    monkeypatch.setattr(PipelinedDraft, "_follow_the_cut",
                        lambda draft, rest, growing: cut.append(growing) or follow_the_cut(draft, rest, growing))
    prompts = list(prompt_ids.values())
    requests = [GenerationRequest(prompts[i % len(prompts)], 40 + 4 * i, policy=POLICIES["svip"]) for i in range(4)]
    for seed in range(3):  # no prepared continuations: no row price learnt from this machine's steps
        pair = make_pair(models, "async", Seeded(seed), draft="target", idle_prefill="off", prepare=0)
        for request, result in zip(requests, pair.generate_all(requests)):
            assert result.token_ids == alone.generate(request).token_ids and not result.stats.detached, seed
    assert cut, "no follow-up was cut before all the draft held of it"


def test_a_stored_row_settled_before_a_step_lets_its_session_ride_and_keeps_every_output(
        models, prompt_ids, alone, monkeypatch):
    """Issue 60, at several sessions: a greedy session waiting on its follow-up whose next token
    the target's stored row already gives settles it before another session's verification step
    (IdleWork.fill_beside), and its next row rides that step. Under random interleavings every
    output is the target alone's, and it happens (the target's own weights draft: every block is
    accepted whole, so the verdict's token waits on the follow-up's first). Nothing reads this
    machine's clock or its step times: the draft never has room before a verdict (a follow-up is
    begun when its verdict comes, so it is late), a row costs it nothing, every waiting session
    rides (idle_prefill "always") and nothing is prepared."""
    import draft_worker.service as service_module
    from coordinator.session.idle_work import IdleWork
    from draft_worker.line_state import VerdictTiming

    monkeypatch.setattr(VerdictTiming, "room_for_a_forward", lambda timing, now, outstanding: False)
    monkeypatch.setattr(service_module, "row_share", lambda cost: 0.0)
    beside = []
    fill_beside = IdleWork.fill_beside
    monkeypatch.setattr(IdleWork, "fill_beside",
                        lambda work, *args: beside.append(fill_beside(work, *args)) or beside[-1])
    prompts = list(prompt_ids.values())
    requests = [GenerationRequest(prompts[i % len(prompts)], 30 + 4 * i, policy=POLICIES["svip"]) for i in range(4)]
    rides = 0
    for seed in range(3):
        pair = make_pair(models, "async", Seeded(seed), draft="target", prepare=0)
        for request, result in zip(requests, pair.generate_all(requests)):
            assert result.token_ids == alone.generate(request).token_ids, seed
        rides += pair.host.idle_work.rides
    assert any(beside) and rides


@pytest.mark.parametrize("seed", range(2))
def test_idle_prefills_priced_at_several_sessions_keep_every_output(models, prompt_ids, alone, seed, monkeypatch):
    """Issue 60: under ``auto`` the target, idle at several sessions, takes in the rows of those
    waiting on their drafts where the blocks due are far enough off (prefills_that_pay; held here
    by construction: every block an hour away) and settles greedy ones' tokens from stored rows.
    Under random interleavings every greedy output is the target alone's, and a seeded sampled
    one is the output with no idle work at all (the rows are the ones its verification computes)."""
    from coordinator.session.waiting import WhileWaiting

    monkeypatch.setattr(WhileWaiting, "block_wait", lambda session, now: 3600.0 if session._waits_on_draft else None)
    prompts = list(prompt_ids.values())
    requests = [GenerationRequest(prompts[i % len(prompts)], 20 + 6 * i, policy=list(POLICIES.values())[i % 3],
                                  sampling=SamplingParams() if i % 2 else SamplingParams(temperature=0.9, seed=i))
                for i in range(4)]
    priced = make_pair(models, "async", Seeded(seed), idle_prefill="auto")
    results = priced.generate_all(requests)
    none = make_pair(models, "async", Seeded(seed), idle_prefill="off").generate_all(requests)
    for request, result, without in zip(requests, results, none):
        expected = alone.generate(request).token_ids if request.sampling.greedy else without.token_ids
        assert result.token_ids == expected
    assert priced.host.idle_work.prefills > len(requests) and priced.host.idle_work.fills > 0  # beyond the prompts


@pytest.mark.parametrize("tree", ["off", "cape"])
@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_seed_gives_one_output_with_rows_stored_ahead_or_not(models, prompt_ids, pipeline, tree):
    """A sampled block is judged on arrival against a row stored ahead (an idle prefill's, or the
    verification's before a follow-up) by the coins its full pass would use; a token tree's first
    place goes to the full pass, whose siblings take the coins after a rejection (judged early,
    they were skipped: two outputs among ten for a CaPE tree). One output for a seed,
    whether or when the target idled."""
    request = GenerationRequest(prompt_ids["long"], 30, sampling=SamplingParams(temperature=0.9, seed=11),
                                policy=dataclasses.replace(POLICIES["svip"], tree=tree))
    outputs, prefills = set(), 0
    for idle_prefill in ("always", "off"):
        for schedule in (TARGET_FIRST, DRAFT_FIRST, Seeded(1), Seeded(2), Seeded(3)):
            pair = make_pair(models, pipeline, schedule, idle_prefill=idle_prefill)
            outputs.add(tuple(pair.generate(request).token_ids))
            prefills += pair.host.idle_work.prefills
    assert len(outputs) == 1 and prefills > 0


class _AlwaysWorthWaiting(BlockArrivals):
    """Arrivals that say every waiting session's block is worth any wait: a step with a session
    waiting on its draft holds until nothing else can happen (the in-memory pair then ends the
    hold, as a real loop's timeout would)."""

    known = True

    def hold_s(self, waiting, forward_s, settles, most_s=None):
        return 3600.0 if waiting else 0.0


@pytest.mark.parametrize("seed", range(3))
def test_steps_held_for_blocks_about_to_come_keep_every_output_the_targets(models, prompt_ids, alone, seed):
    """Issue 60: with blocks ready, the target's step may wait for the blocks of sessions whose
    drafts are drafting after a verdict (svip_common/arrivals.py). Held at every chance, under
    random interleavings, every greedy output is the target alone's and a seeded sampled one the
    same as with no hold; and holds happen."""
    pair = make_pair(models, "async", Seeded(seed), idle_prefill="auto")
    pair.host.idle_work.arrivals = _AlwaysWorthWaiting()
    prompts = list(prompt_ids.values())
    sampled = GenerationRequest(prompts[0], 20, SamplingParams(temperature=0.9, top_p=0.95, seed=11), POLICIES["svip"])
    requests = [GenerationRequest(prompts[i % len(prompts)], 16 + 6 * i, policy=list(POLICIES.values())[i % 3])
                for i in range(4)] + [sampled]
    results = pair.generate_all(requests)
    for request, result in zip(requests[:-1], results):
        assert result.token_ids == alone.generate(request).token_ids
    assert results[-1].token_ids == make_pair(models, "async").generate(sampled).token_ids
    assert pair.host.idle_work.holds > 0


def test_a_held_step_whose_sessions_end_leaves_nothing_to_wake_for(models, prompt_ids):
    """A step held for blocks about to come whose ready sessions are cancelled meanwhile has no
    step left to start: the hold is dropped, so the compute loop does not wake for it again and
    again (a real loop would spin on a timeout of 0)."""
    pair = make_pair(models, "async", TARGET_FIRST, idle_prefill="auto")
    pair.host.idle_work.arrivals = _AlwaysWorthWaiting()
    prompts = list(prompt_ids.values())
    pending = [pair.submit(GenerationRequest(prompts[i], 40, policy=POLICIES["svip"])) for i in range(3)]
    while pair.host.idle_work.wake_in() is None:
        assert pair.step() is not None and not all(p.done for p in pending)
    for p in pending:
        pair.cancel(p)
    pair.run()
    for _ in range(1000):  # what is left to do after the cancels (a stale hold: the target's idle again and again)
        if pair.step() is None:
            break
    assert pair.host.idle_work.wake_in() is None and pair.step() is None


def test_the_sampling_distribution_with_steps_held_at_every_chance(models, prompt_ids):
    """As the random-interleavings test above, with the target's step held for blocks about to
    come at every chance (issue 60): a hold changes when a step runs, never what a verdict draws,
    so the first two tokens still follow the target's exact marginals, not the draft's."""
    pair = make_pair(models, "async", Seeded(7), idle_prefill="auto")
    pair.host.idle_work.arrivals = _AlwaysWorthWaiting()
    # long enough for blocks drafted after a verdict, the ones a step holds for
    _first_two_follow_the_target(pair, models, prompt_ids["medium"], PLAIN, tokens=6)
    assert pair.host.idle_work.holds > 0


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_auto_learns_an_overlapped_block_as_costing_its_round_the_targets_step(models, prompt_ids, alone, pipeline,
                                                                               monkeypatch):
    """Policy auto across the workers: a block verified with no round trip (a follow-up held at
    its verdict, a prepared continuation) was drafted while the target verified the one before,
    so the target's estimate learns it as overlapped (svip_common/acceptance.py SessionStop.record);
    every block of sync, and each one the target waited for, as before. Output exact."""
    from svip_common.acceptance import SessionStop

    seen, record = [], SessionStop.record
    monkeypatch.setattr(SessionStop, "record",
                        lambda self, *a, overlapped=False, **k: seen.append(overlapped) or record(
                            self, *a, overlapped=overlapped, **k))
    pair = make_pair(models, pipeline, DRAFT_FIRST, draft="target")  # all accepted: follow-ups held
    request = GenerationRequest(prompt_ids["medium"], MAX_NEW, policy=PolicyConfig(name="auto"))
    result = pair.generate(request)
    assert result.token_ids == alone.generate(request).token_ids
    held = result.stats.round_sources.count("followup") + result.stats.round_sources.count("prepared")
    assert seen.count(True) == held and (held >= 1 if pipeline == "async" else held == 0)
    assert False in seen


def test_a_block_timed_past_any_clock_loses_its_sessions_draft_and_not_its_neighbours(models, prompt_ids, alone,
                                                                                     monkeypatch):
    """A draft's timings feed auto's price (coordinator/session/wire_checks.py MAX_TIMING_S): a
    block whose finished_at is past any clock gives the draft up for its session alone, which
    goes on with the target and ends exact; the session beside it keeps its draft, also exact."""
    from coordinator.session import host
    from svip_common.messages import DraftedBlock

    real, hit = host.convert.draft_event_from_proto, []

    def past_any_clock(event, width=None):
        read = real(event, width)
        if isinstance(read, DraftedBlock) and read.tokens and not hit:
            hit.append(event.block.session_id)
            read.finished_at = 1e13
        return read

    monkeypatch.setattr(host.convert, "draft_event_from_proto", past_any_clock)
    pair = make_pair(models, "async", DRAFT_FIRST)
    requests = [GenerationRequest(prompt_ids[name], MAX_NEW, policy=PolicyConfig(name="auto"))
                for name in ("short", "medium")]
    results = pair.generate_all(requests)
    assert len(hit) == 1
    assert [r.token_ids for r in results] == [alone.generate(r).token_ids for r in requests]
    assert sorted(r.stats.detached for r in results) == [0, 1]
    assert next(r for r in results if not r.stats.detached).stats.draft_tokens > 0


@pytest.mark.parametrize("price", [0.0, 0.5, 1.5])
def test_async_chains_at_load_draft_past_a_stop_only_while_the_targets_node_price_pays(
        models, prompt_ids, alone, monkeypatch, price):
    """Issue 60: where sessions share the target, the target's node price reaches each async chain's
    draft, and a block drafts past its stop only while its reach beats it (stepping.py
    ``_extends``). The price is pinned here once the target has timed its forwards (0 before: its fits
    read this machine's clock): at 0 the drafts go on past their stops, at 1.5 none does (a reach is
    at most 1), and under three random interleavings every output is the target alone's, no
    session giving its draft up."""
    import coordinator.session.speculation as speculation_module
    from draft_worker.stepping import Stepping

    monkeypatch.setattr(speculation_module, "node_price", lambda rate, token_s: price)
    real, seen = Stepping._extends, []

    def watched(draft, job):
        extends = real(draft, job)
        seen.append((draft.shared, draft.session.node_price, job.draft.reach, extends))
        return extends

    monkeypatch.setattr(Stepping, "_extends", watched)
    requests = [GenerationRequest(prompt_ids[name], 24) for name in ("short", "medium", "long", "short")]
    for seed in range(3):
        results = make_pair(models, "async", Seeded(seed)).generate_all(requests)
        assert [r.token_ids for r in results] == [alone.generate(r).token_ids for r in requests], seed
        assert not any(r.stats.detached for r in results), seed
    shared = [(node_price, reach, extends) for is_shared, node_price, reach, extends in seen if is_shared]
    assert shared and {node_price for node_price, _, _ in shared} <= {0.0, price}  # 0 until the load is timed
    assert not any(extends and reach <= node_price for node_price, reach, extends in shared)  # never unpaid
    priced = [extends for node_price, _, extends in shared if node_price == price]
    assert priced and (any(priced) if price == 0.0 else not any(priced) if price == 1.5 else True)


def test_a_bad_tree_growth_loses_its_sessions_draft_and_not_its_neighbours(models, prompt_ids, alone, monkeypatch):
    """A flat tree's growth whose siblings are not well formed (here one equal to its place's token,
    wire_checks.py ``check_growth``) gives the draft up for its session alone, which goes on with
    the target and ends exact; the session beside it keeps its draft and its growths, also exact.
    Growth runs as in the flat-tree test above. A growth on a rolled-back base is dropped
    unchecked, and whether one is depends on the target's timed forwards (its node price), so the
    schedules are tried until the target refused one (``check_growth`` raised); every run is exact."""
    import coordinator.session.pipeline as pipeline_module
    import draft_worker.service as service_module
    from coordinator.session import host
    from draft_worker.stepping import Stepping
    from svip_common.errors import WorkerError
    from svip_common.messages import DraftedBlock
    from tests.policies import TREE_POLICIES

    monkeypatch.setattr(service_module, "row_share", lambda cost: 0.0)
    monkeypatch.setattr(Stepping, "_extends", lambda draft, job: job is not draft.critical and bool(
        draft.outstanding) and job.draft.extended < 3)
    real, hit = host.convert.draft_event_from_proto, []

    def a_sibling_equal_to_its_token(event, width=None):
        read = real(event, width)
        if isinstance(read, DraftedBlock) and read.grows and read.block.siblings is not None \
                and event.block.session_id in (hit or [event.block.session_id]):  # one session's, each
            hit.append(event.block.session_id)  # (one on a rolled-back base is dropped unchecked)
            read.block.siblings[0] = [read.block.tokens[0]]
        return read

    monkeypatch.setattr(host.convert, "draft_event_from_proto", a_sibling_equal_to_its_token)
    checked, refused = pipeline_module.check_growth, []

    def counted_check(block, request, limits):
        try:
            checked(block, request, limits)
        except WorkerError:
            refused.append(block.base)
            raise

    monkeypatch.setattr(pipeline_module, "check_growth", counted_check)
    requests = [GenerationRequest(prompt_ids[name], 40, policy=TREE_POLICIES["svip-cape"])
                for name in ("short", "medium")]
    for seed in range(12):
        hit.clear()
        results = make_pair(models, "async", Seeded(seed)).generate_all(requests)
        assert [r.token_ids for r in results] == [alone.generate(r).token_ids for r in requests], seed
        if refused:
            assert sorted(r.stats.detached for r in results) == [0, 1], seed
            assert next(r for r in results if not r.stats.detached).stats.draft_tokens > 0
            break
        assert not any(r.stats.detached for r in results), seed  # no growth refused: none gave its draft up
    assert refused, "no bad tree growth reached the target's check"
