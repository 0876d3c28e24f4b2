"""Sessions that begin alike share the pages of what they share, on the target and on the draft
(svip_common/prompt_sharing.py): a request's n choices prefill their prompt once on each, greedy
outputs unchanged and sampled ones each its seed's alone to the bit, in the in-process batch and
through the workers (the in-memory transport under orders that favour either side); the pages
come back when the last holder closes."""

from __future__ import annotations

import dataclasses

import pytest

from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_common.randomness import choices
from svip_proto import svip_pb2 as pb
from tests.integration.test_in_memory import DRAFT_FIRST, TARGET_FIRST, Seeded, make_pair

N = 4


def prompt(prompt_ids) -> tuple[int, ...]:
    return (prompt_ids["long"] * 4)[:70]  # four pages and a part


def choice_requests(prompt_ids, sampled: bool) -> list[GenerationRequest]:
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=11) if sampled else SamplingParams()
    request = GenerationRequest(prompt(prompt_ids), 24, sampling=sampling, policy=PolicyConfig(name="svip"),
                                ignore_eos=True)
    return choices(request, N) if sampled else [request] * N


def batch_run(models, requests, sharing: bool):
    from coordinator.engine import SpeculativeEngine

    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    engine.verifier.sharing.forks = engine.drafter.sharing.forks = sharing
    results = engine.batch(N).generate_all(requests)
    return results, engine.verifier, engine.drafter


def each_alone(models, requests):
    """Each request in an engine of its own, prompt sharing on as deployed: nothing to share with."""
    from coordinator.engine import SpeculativeEngine

    return [SpeculativeEngine(models["target"], models["close_draft"], load_aware="off").generate(r) for r in requests]


@pytest.mark.parametrize("sampled", [False, True])
def test_n_choices_in_one_batch_prefill_their_prompt_once(models, prompt_ids, sampled):
    """Greedy or sampled, each choice equals its request alone (a sampled one to the bit: its seed
    reproduces whoever held the prompt), and the prompt is computed once on each side."""
    requests = choice_requests(prompt_ids, sampled)
    shared, verifier, drafter = batch_run(models, requests, sharing=True)
    apart, alone, draft_alone = batch_run(models, requests, sharing=False)
    assert [r.token_ids for r in shared] == [r.token_ids for r in apart]
    assert [r.token_ids for r in shared] == [r.token_ids for r in each_alone(models, requests)]
    saved = (N - 1) * (len(requests[0].prompt_ids) - 1)
    assert verifier.sharing.shared_tokens == saved and alone.sharing.shared_tokens == 0
    assert alone.pool.forward_tokens - verifier.pool.forward_tokens == saved
    assert drafter.sharing.shared_tokens == saved and draft_alone.sharing.shared_tokens == 0
    assert draft_alone.pool.forward_tokens - drafter.pool.forward_tokens == saved
    for pool in (verifier.pool, drafter.pool):  # every shared page back once its last holder closed
        assert pool.free_pages == pool.pages


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("pipeline", ["sync", "async"])
@pytest.mark.parametrize("schedule", ["target first", "draft first", "seeded"])
def test_n_choices_through_the_workers_share_and_equal_them_apart(models, prompt_ids, pipeline, schedule, sampled):
    order = {"target first": TARGET_FIRST, "draft first": DRAFT_FIRST, "seeded": Seeded(3)}[schedule]
    requests = choice_requests(prompt_ids, sampled)
    pair = make_pair(models, pipeline, order)
    apart = make_pair(models, pipeline, order)
    apart.host.verifier.sharing.forks = apart.draft.drafter.sharing.forks = False
    got = pair.generate_all(requests)
    assert [r.token_ids for r in got] == [r.token_ids for r in apart.generate_all(requests)]
    solo = make_pair(models, pipeline, order)  # each request alone, sharing on: a sampled one to the bit
    assert [r.token_ids for r in got] == [solo.generate_all([r])[0].token_ids for r in requests]
    shared, alone = pair.host.verifier, apart.host.verifier
    drafter = pair.draft.drafter
    assert shared.sharing.shared_tokens > 0
    # forward tokens net of the follow-ups' fed after their blocks (Lookahead): those follow the schedule
    assert shared.pool.forward_tokens - shared.fed_ahead < alone.pool.forward_tokens - alone.fed_ahead
    if schedule != "target first":  # target first: the target fills every round, no draft runs
        # (its forward tokens in all are no measure here: how far speculation drafts past its stops
        # follows when each verdict comes, which sharing moves)
        assert drafter.sharing.shared_tokens > 0
    stats = pb.WorkerStats()
    pair.host.add_stats(stats)  # what the target's Stats answers, and Prometheus counts up
    assert stats.prompt_tokens_shared == shared.sharing.shared_tokens


def test_a_shared_page_written_by_one_holder_is_copied_for_it(models, prompt_ids):
    """Prompts that part mid-page: each session writes its own tokens into a copy of the page they
    shared, and both outputs equal their own runs apart."""
    base = prompt(prompt_ids)
    requests = [GenerationRequest(base[:40] + tail, 16, ignore_eos=True) for tail in ((7, 8, 9), (9, 8, 7, 6))]
    shared, verifier, drafter = batch_run(models, requests, sharing=True)
    apart, *_ = batch_run(models, requests, sharing=False)
    assert [r.token_ids for r in shared] == [r.token_ids for r in apart]
    assert verifier.sharing.shared_tokens == drafter.sharing.shared_tokens == 40


def test_sessions_share_nothing_under_a_page_or_with_a_feature_draft(models, prompt_ids):
    short = [GenerationRequest(prompt(prompt_ids)[:16], 8, ignore_eos=True)] * 2  # one page: its last token is its own
    _, verifier, drafter = batch_run(models, short, sharing=True)
    assert verifier.sharing.shared_tokens == drafter.sharing.shared_tokens == 0
    from target_worker.verifier import Verifier

    assert not Verifier(models["target"], feature_layers=(0,)).sharing.enabled


def test_the_greedy_reference_holds(models, prompt_ids):
    """Shared or not, each choice is the target alone's output (the reference the others rest on)."""
    from coordinator.engine import SpeculativeEngine

    requests = choice_requests(prompt_ids, sampled=False)
    shared, *_ = batch_run(models, requests, sharing=True)
    alone = SpeculativeEngine(models["target"], None).generate(dataclasses.replace(requests[0]))
    assert all(r.token_ids == alone.token_ids for r in shared)


# Prompt lengths at which a prompt computed in one forward gives its last row other bits than
# computed in two (every token but the last, then the last with the block), on this machine's
# kernels: a fork that took the wrong rows shows in the logprobs' bits. Runs alone only: a batch's
# other rows move a row's last bits too, as in any batched engine (docs/architecture.md).
ROUNDING_LENGTHS = (34, 48, 62)


def seeded(prompt_ids, length: int, greedy: bool = False) -> GenerationRequest:
    sampling = SamplingParams() if greedy else SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    return GenerationRequest(prompt(prompt_ids)[:length], 12, sampling=sampling, policy=PolicyConfig(name="svip"),
                             ignore_eos=True, logprobs=2)


def bits(result) -> tuple:
    return result.token_ids, [(t.token, t.logprob, tuple(t.top)) for t in result.logprobs]


def beside_a_holder(models, holder: GenerationRequest, request: GenerationRequest):
    """The request run alone while the holder's session stays open, one round in (its prompt in
    both caches, idle, as a finished request's draft session may still be): what each side shared."""
    from coordinator.engine import SpeculativeEngine

    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    held = engine.open(holder)
    try:
        block = held.propose()
        held.settle(block, held.target.verify(held.committed, block))
        result = engine.generate(request)
    finally:
        held.close()
    return result, engine.verifier.sharing.shared_tokens, engine.drafter.sharing.shared_tokens


def test_a_sampled_request_that_forks_its_prompt_equals_itself_alone_to_the_bit(models, prompt_ids):
    """A seeded request and the same request again while the first one's sessions are still open:
    the second forks the prompt on each side and draws, with the target's logprobs as floats,
    exactly what it draws alone (it computes its last prompt token in a forward of its own after
    the rest, as a fork does: the split, prompt_sharing.py)."""
    for length in ROUNDING_LENGTHS:
        request = seeded(prompt_ids, length)
        got, target_shared, draft_shared = beside_a_holder(models, request, request)
        assert target_shared == draft_shared == length - 1
        assert bits(got) == bits(each_alone(models, [request])[0]), length


def test_a_sampled_request_forks_no_prompt_computed_in_another_shape(models, prompt_ids):
    """A greedy session's prompt or a scoring request's (one forward, its last token in it) or a
    longer prompt's prefix holds other bits than a sampled request's own split prefill: it forks
    none of them (on the draft, the scoring request's prompt is split as any other)."""
    for length in ROUNDING_LENGTHS:
        request = seeded(prompt_ids, length)
        scoring = dataclasses.replace(request, prompt_logprobs=True)
        for holder in (seeded(prompt_ids, length, greedy=True), seeded(prompt_ids, length + 20), scoring):
            got, target_shared, draft_shared = beside_a_holder(models, holder, request)
            assert target_shared == 0 and draft_shared == (length - 1 if holder is scoring else 0)
            assert bits(got) == bits(each_alone(models, [request])[0]), length


def scoped(request: GenerationRequest, scope: str) -> GenerationRequest:
    return dataclasses.replace(request, cache_scope=scope)


@pytest.mark.parametrize("sampled", [False, True])
def test_tenants_share_no_pages_and_one_tenants_requests_do(models, prompt_ids, sampled):
    """Review H-1: sessions of two scopes (two API keys) with one prompt, open at once, fork nothing
    of each other's on either side, nor wait for each other, so nothing one computes shortens the
    other's prefill; two requests of one scope share as before. Outputs are each its own alone."""
    requests = choice_requests(prompt_ids, sampled)[:2]
    apart, verifier, drafter = batch_run(models, [scoped(requests[0], "alice"), scoped(requests[1], "bob")], True)
    assert verifier.sharing.shared_tokens == drafter.sharing.shared_tokens == 0
    together, verifier, drafter = batch_run(models, [scoped(r, "alice") for r in requests], True)
    assert verifier.sharing.shared_tokens == drafter.sharing.shared_tokens == len(requests[0].prompt_ids) - 1
    assert [r.token_ids for r in apart] == [r.token_ids for r in together]
    assert [r.token_ids for r in apart] == [r.token_ids for r in each_alone(models, requests)]


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_the_scope_travels_to_both_workers(models, prompt_ids, pipeline):
    """Through the workers' wire (StartSession.cache_scope, caller to target to draft): another
    tenant's open session with the same prompt is forked by neither side, a same-scope one by both."""
    request = dataclasses.replace(choice_requests(prompt_ids, sampled=False)[0], max_new_tokens=8)
    for other, shares in (("bob", False), ("alice", True)):
        pair = make_pair(models, pipeline, DRAFT_FIRST)
        got = pair.generate_all([scoped(request, "alice"), scoped(request, other)])
        assert got[0].token_ids == got[1].token_ids
        target, draft = pair.host.verifier.sharing.shared_tokens, pair.draft.drafter.sharing.shared_tokens
        assert (target > 0 and draft > 0) if shares else (target == draft == 0), other


def test_a_scope_past_its_bound_is_refused_by_name(prompt_ids):
    from svip_common.contracts import MAX_CACHE_SCOPE, Limits
    from svip_common.errors import InvalidRequest
    from svip_proto import convert

    request = scoped(GenerationRequest(prompt_ids["short"], 4), "x" * (MAX_CACHE_SCOPE + 1))
    with pytest.raises(InvalidRequest, match="cache_scope must be a string of at most 128 characters"):
        request.validate(Limits(tokens=1000, positions=512))
    start = pb.StartSession(session_id="s", prompt_ids=[1, 2], max_new_tokens=4, cache_scope="x" * 129,
                            sampling=convert.sampling_to_proto(SamplingParams()))
    with pytest.raises(InvalidRequest, match="cache_scope"):
        convert.start_from_proto(start)
    start.cache_scope = "x" * MAX_CACHE_SCOPE
    assert convert.start_from_proto(start).cache_scope == "x" * MAX_CACHE_SCOPE
