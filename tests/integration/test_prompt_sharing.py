"""Sessions that begin alike share the pages of what they share, on the target and on the draft
(svip_common/prompt_sharing.py): a request's n choices prefill their prompt once on each, greedy
and sampled outputs unchanged, in the in-process batch and through the workers (the in-memory
transport under orders that favour either side); the pages come back when the last holder closes."""

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

    engine = SpeculativeEngine(models["target"], models["close_draft"])
    engine.verifier.sharing.enabled = engine.drafter.sharing.enabled = sharing
    results = engine.batch(N).generate_all(requests)
    return results, engine.verifier, engine.drafter


@pytest.mark.parametrize("sampled", [False, True])
def test_n_choices_in_one_batch_prefill_their_prompt_once(models, prompt_ids, sampled):
    requests = choice_requests(prompt_ids, sampled)
    shared, verifier, drafter = batch_run(models, requests, sharing=True)
    apart, alone, draft_alone = batch_run(models, requests, sharing=False)
    assert [r.token_ids for r in shared] == [r.token_ids for r in apart]
    # greedy: the prompt once; sampled: none shared (a seeded draw must not rest on another session's cache)
    saved = 0 if sampled else (N - 1) * (len(requests[0].prompt_ids) - 1)
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
    apart.host.verifier.sharing.enabled = apart.draft.drafter.sharing.enabled = False
    got, want = pair.generate_all(requests), apart.generate_all(requests)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    shared, alone = pair.host.verifier, apart.host.verifier
    drafter, draft_alone = pair.draft.drafter, apart.draft.drafter
    if sampled:  # a seeded draw must not rest on another session's cache: nothing shared
        assert shared.sharing.shared_tokens == drafter.sharing.shared_tokens == 0
    else:
        assert shared.sharing.shared_tokens > 0 and shared.pool.forward_tokens < alone.pool.forward_tokens
    if schedule != "target first" and not sampled:  # target first: the target fills every round, no draft runs
        assert drafter.sharing.shared_tokens > 0 and drafter.pool.forward_tokens < draft_alone.pool.forward_tokens
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
