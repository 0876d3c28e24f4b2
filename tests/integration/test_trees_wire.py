"""Token trees across the workers (issue 44), through the in-memory transport (every block and
feedback serialised through the wire contract): greedy output equals the target alone in sync and
async mode, under orders that favour either worker and under random interleavings; siblings
settle rejected places there as in process (the verdict's branch reaches the draft, which drafts
on from the sibling, or from the child grown below it: tree deep); `auto` prices its nodes at
the load the target sends; a draft worker whose trees break the rules gives the draft up for that
session, never the output; and a sampled tree (its q rows on the wire) follows the target's
distribution."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.engine import SpeculativeEngine
from coordinator.in_memory import Seeded
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_common.trees import MAX_TREE_NODES
from tests.integration.test_in_memory import DRAFT_FIRST, TARGET_FIRST, make_pair
from tests.integration.test_sampling_exact import assert_first_tokens_follow_the_target
from tests.integration.test_trees import last_forward_rule
from tests.policies import TREE_POLICIES

MAX_NEW = 32


@pytest.fixture(scope="module")
def alone(models, prompt_ids):
    engine = SpeculativeEngine(models["target"], None)
    return {ids: engine.generate(GenerationRequest(ids, MAX_NEW)).token_ids for ids in prompt_ids.values()}


@pytest.mark.parametrize("pipeline", ["sync", "async"])
@pytest.mark.parametrize("policy", list(TREE_POLICIES))
@pytest.mark.parametrize("schedule", ["target first", "draft first"])
def test_a_tree_across_the_workers_settles_what_the_target_alone_settles(models, prompt_ids, alone, pipeline,
                                                                         policy, schedule):
    pair = make_pair(models, pipeline, TARGET_FIRST if schedule == "target first" else DRAFT_FIRST)
    requests = [GenerationRequest(ids, MAX_NEW, policy=TREE_POLICIES[policy]) for ids in prompt_ids.values()]
    results = pair.generate_all(requests)
    for request, result in zip(requests, results):
        assert result.token_ids == alone[request.prompt_ids], (pipeline, policy, schedule)
        assert result.stats.detached == 0
    # siblings verified: with CaPE's fixed widths and the draft first (target first: the target settles
    # alone what it can before any block); tree auto keeps the siblings that pay at the target's
    # measured load, which the wall clock sets (its pricing: test_auto_prices_nodes_at_the_load_the_target_sends)
    if schedule == "draft first" and TREE_POLICIES[policy].tree == "cape":
        assert sum(r.stats.tree_nodes for r in results) > sum(r.stats.draft_tokens for r in results) > 0


@pytest.mark.parametrize("seed", range(4))
def test_trees_and_chains_are_exact_under_random_interleavings(models, prompt_ids, alone, seed):
    pair = make_pair(models, "async" if seed % 2 else "sync", Seeded(seed), load_aware="greedy")
    prompts = list(prompt_ids.values())
    policies = [*TREE_POLICIES.values(), PolicyConfig(name="svip", threshold=0.6)]
    requests = [GenerationRequest(prompts[i % len(prompts)], MAX_NEW, policy=policies[i % len(policies)])
                for i in range(8)]
    results = pair.generate_all(requests)
    assert [r.token_ids for r in results] == [alone[r.prompt_ids] for r in requests]


def test_siblings_settle_rejected_places_across_the_workers(models, prompt_ids, alone):
    """A branch settles the sibling and the place after it in one round, and the draft drafts on
    from there: more tokens a round than the same stop's chain, as in process."""
    chain = PolicyConfig(name="constant", draft_length=3)
    tree = PolicyConfig(name="constant", draft_length=3, tree="cape")
    per_round = {}
    for name, policy in (("chain", chain), ("tree", tree)):
        results = make_pair(models, "sync", DRAFT_FIRST).generate_all(
            [GenerationRequest(ids, MAX_NEW, policy=policy) for ids in prompt_ids.values()])
        assert [r.token_ids for r in results] == [alone[ids] for ids in prompt_ids.values()]
        per_round[name] = sum(len(r.token_ids) for r in results) / sum(r.stats.rounds for r in results)
        if name == "tree":
            assert sum(r.stats.branches for r in results) > 0
    assert per_round["tree"] > per_round["chain"]


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_deep_branch_reaches_the_draft_across_the_workers(models, prompt_ids, alone, pipeline):
    """tree deep: the grown nodes cross the wire with their block, and a verdict that takes a
    sibling and its child tells the draft both (the feedback's branch path), which drafts on
    after them: output exact, and some rounds settle two tokens off the spine."""
    policy = PolicyConfig(name="constant", draft_length=3, tree="deep")
    results = make_pair(models, pipeline, DRAFT_FIRST).generate_all(
        [GenerationRequest(ids, MAX_NEW, policy=policy) for ids in prompt_ids.values()])
    assert [r.token_ids for r in results] == [alone[ids] for ids in prompt_ids.values()]
    assert all(r.stats.detached == 0 for r in results)
    assert sum(r.stats.branch_tokens - r.stats.branches for r in results) > 0


def test_a_continuation_prepared_after_a_sibling_serves_its_deep_branch_across_the_workers(
        models, prompt_ids, alone, monkeypatch):
    """async, tree deep: where the verdict takes a sibling and the child grown below it, the
    continuation prepared after that sibling begins with the child (the draft's choice after the
    sibling, both ways) and is verified next, with no round trip: some are, and the output stays
    the target alone's. Nothing here reads this machine's clock: the draft always has room before
    a verdict (VerdictTiming) and a speculative row is free (its price is the measured steps'), so
    which continuations are prepared, and ready at their verdicts, is the schedule's alone."""
    from coordinator.session.ahead import AheadBlocks
    from draft_worker import service
    from draft_worker.line_state import VerdictTiming

    monkeypatch.setattr(VerdictTiming, "room_for_a_forward", lambda timing, now, outstanding: True)
    monkeypatch.setattr(service, "row_share", lambda cost: 0.0)
    taken = []
    take = AheadBlocks.take_prepared

    def spied(self, base, accepted, token, branch=()):
        waiting = take(self, base, accepted, token, branch)
        taken.append((branch[1:], waiting is not None))
        return waiting

    monkeypatch.setattr(AheadBlocks, "take_prepared", spied)
    policy = PolicyConfig(name="constant", draft_length=3, tree="deep")
    results = make_pair(models, "async", DRAFT_FIRST).generate_all(
        [GenerationRequest(ids, MAX_NEW, policy=policy) for ids in prompt_ids.values()])
    assert [r.token_ids for r in results] == [alone[ids] for ids in prompt_ids.values()]
    assert any(then and found for then, found in taken)


def test_auto_prices_nodes_at_the_load_the_target_sends(models, prompt_ids, alone):
    """The target's feedback carries tree auto's node price: at a price above any sibling's chance
    the draft sends chains (no sibling pays), and the output stays the target alone's."""
    request = GenerationRequest(prompt_ids["medium"], MAX_NEW, policy=TREE_POLICIES["svip-auto"])
    pair = make_pair(models, "async", DRAFT_FIRST)
    pair.host.verifier.load = lambda *a, **k: _Load(0.0)  # a node costs nothing: every CaPE sibling pays
    free = pair.generate(request)
    assert free.token_ids == alone[request.prompt_ids] and free.stats.tree_nodes > free.stats.draft_tokens
    pair = make_pair(models, "async", DRAFT_FIRST)
    pair.host.verifier.load = lambda *a, **k: _Load(1.0)
    dear = pair.generate(request)
    assert dear.token_ids == alone[request.prompt_ids]
    assert dear.stats.rounds > 1 and dear.stats.branches == 0


def test_a_cape_session_takes_the_node_price_and_keeps_its_width(models, prompt_ids, alone, monkeypatch):
    """Every tree's session gets the node price now (a continuation taken up past a sibling keeps
    the places that pay: BlockDraft.go_on_past); CaPE's siblings are not priced by it: at a price
    no sibling would pay, its trees keep their width, and the output stays the target alone's."""
    from draft_worker import service

    taken, price = [], service._price
    monkeypatch.setattr(service, "_price", lambda session, p: (taken.append(p), price(session, p))[1])
    request = GenerationRequest(prompt_ids["medium"], MAX_NEW, policy=PolicyConfig(name="svip", threshold=0.6,
                                                                                   tree="cape"))
    pair = make_pair(models, "async", DRAFT_FIRST)
    pair.host.verifier.load = lambda *a, **k: _Load(1.0)
    dear = pair.generate(request)
    assert dear.token_ids == alone[request.prompt_ids] and dear.stats.tree_nodes > dear.stats.draft_tokens
    assert 1000.0 in taken  # the price the target's load sets reached the draft's CaPE session


class _Load:
    """The target's load as the test sets it (not as the wall clock measures it): verify_token_s 1
    makes a node cost 1000 tokens, 0 nothing."""

    plain_rate, batch = 1000.0, 1.0

    def __init__(self, verify_token_s: float):
        self.verify_token_s = verify_token_s

    def round_tokens(self, round_overhead_s: float) -> float:
        return 0.0


def test_a_tree_the_rules_refuse_gives_the_draft_up_not_the_output(models, prompt_ids, alone, monkeypatch):
    """A draft worker that sends a tree past the node cap: the target gives the draft up for that
    session and settles the rest alone, exact; a chain session batched beside it keeps its draft."""
    from draft_worker import drafter

    monkeypatch.setattr(drafter, "MAX_TREE_NODES", 4 * MAX_TREE_NODES)  # the draft side's bound, loosened
    monkeypatch.setattr(drafter, "cape_siblings", lambda p, ranked, room, reach=1.0, price=0.0: [t for t, _ in ranked])
    _gives_the_draft_up_beside_a_chain(models, prompt_ids, alone, PolicyConfig(name="constant", draft_length=10,
                                                                                tree="cape"))


def _gives_the_draft_up_beside_a_chain(models, prompt_ids, alone, policy: PolicyConfig) -> None:
    """A tree session whose draft worker breaks the rules, batched beside a chain session (sync,
    the draft first): the tree's draft is given up and its output stays exact; the chain keeps its
    draft and its own exact output."""
    pair = make_pair(models, "sync", DRAFT_FIRST)
    neighbour = GenerationRequest(prompt_ids["long"], MAX_NEW, policy=PolicyConfig(name="constant", draft_length=3))
    result, beside = pair.generate_all([GenerationRequest(prompt_ids["medium"], MAX_NEW, policy=policy), neighbour])
    assert result.token_ids == alone[prompt_ids["medium"]]
    assert result.stats.detached == 1
    assert beside.token_ids == alone[prompt_ids["long"]]
    assert beside.stats.detached == 0 and beside.stats.accepted_tokens > 0


PLAIN, WARPED = SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=40, top_p=0.9)


@pytest.mark.parametrize("pipeline, sampling", [
    ("async", PLAIN), pytest.param("sync", WARPED, marks=pytest.mark.system),
    pytest.param("async", WARPED, marks=pytest.mark.system),
], ids=["plain-async", "warped-sync", "warped-async"])
def test_a_sampled_tree_across_the_workers_follows_the_target(models, prompt_ids, pipeline, sampling):
    """A sampled tree crosses the workers with the draft's q rows: the target tries the siblings
    at a rejected place against the residual max(0, p - q) and draws the correction itself. The
    first two tokens of 1,500 seeded requests, 50 in flight, their steps interleaved at random,
    follow the target's exact marginals (not the draft's); siblings were taken, and (async,
    plain) continuations prepared for the target's draws were verified; warped, the q rows travel by their
    ids with mass."""
    prompt = prompt_ids["medium"]
    pair = make_pair(models, pipeline, Seeded(7 + len(pipeline)))
    policy = PolicyConfig(name="constant", draft_length=3, tree="cape")
    requests = [GenerationRequest(prompt, 3, dataclasses.replace(sampling, seed=s), policy) for s in range(1500)]
    results = [r for i in range(0, len(requests), 50) for r in pair.generate_all(requests[i:i + 50])]
    assert sum(r.stats.branches for r in results) > len(requests) // 20  # siblings really were taken
    assert all(r.stats.detached == 0 for r in results)  # the draft drafted every tree to the end
    if pipeline == "async" and sampling is PLAIN:  # the target settles a tree's rejected place: one prepared serves
        assert sum(r.stats.prepared_used for r in results) > 0
    assert_first_tokens_follow_the_target(models, prompt, sampling, results)
    nodes = sum(r.stats.tree_nodes for r in results)
    if sampling.top_p < 1.0:
        row = models["target"].vocab_size * 4  # a whole float32 q row
        assert sum(r.stats.wire_bytes for r in results) < nodes * row / 4  # rows by ids


def test_grown_nodes_the_rules_refuse_give_the_draft_up_not_the_output(models, prompt_ids, alone, monkeypatch):
    """A draft worker whose deep trees repeat a child under its sibling: the target gives the draft
    up for that session and settles the rest alone, exact; a chain session beside it keeps its draft."""
    from draft_worker import drafter

    monkeypatch.setattr(drafter, "grown_children", lambda ranked, reach, price, room: [ranked[0][0]] * 2)
    _gives_the_draft_up_beside_a_chain(models, prompt_ids, alone, PolicyConfig(name="constant", draft_length=3,
                                                                                tree="deep"))


def test_a_sampled_deep_tree_across_the_workers_follows_the_target(models, prompt_ids):
    """A sampled deep tree crosses the workers with its grown children: below a taken sibling the
    target tries its child against p at the sibling's row and tells the draft the two-token
    branch. The first two tokens of 1,500 seeded requests (async, interleaved at random, the short
    prompt, where this pair's siblings are taken most) follow the target's marginals, and grown
    children were taken."""
    prompt = prompt_ids["short"]
    pair = make_pair(models, "async", Seeded(11))
    policy = PolicyConfig(name="constant", draft_length=3, tree="deep")
    requests = [GenerationRequest(prompt, 3, dataclasses.replace(PLAIN, seed=s), policy) for s in range(1500)]
    results = [r for i in range(0, len(requests), 50) for r in pair.generate_all(requests[i:i + 50])]
    assert all(r.stats.detached == 0 for r in results)
    assert sum(r.stats.branch_tokens - r.stats.branches for r in results) > 0  # a child below a sibling taken
    assert_first_tokens_follow_the_target(models, prompt, PLAIN, results)


@pytest.mark.parametrize("pipeline", ["sync", "async"])
@pytest.mark.parametrize("rule", ["priced", "never"])
def test_deep_auto_across_the_workers_settles_what_the_target_alone_settles_where_its_last_forward_is_skipped(
        models, prompt_ids, alone, monkeypatch, pipeline, rule):
    """deep-auto under SVIP across the workers (its last forward priced at the session's rate, or
    never taken): greedy output equals the target alone's under random interleavings."""
    asked = last_forward_rule(monkeypatch, rule)
    pair = make_pair(models, pipeline, Seeded(3))
    policy = PolicyConfig(name="svip", threshold=0.6, tree="deep-auto")
    requests = [GenerationRequest(ids, MAX_NEW, policy=policy) for ids in prompt_ids.values()]
    results = pair.generate_all(requests)
    assert [r.token_ids for r in results] == [alone[r.prompt_ids] for r in requests]
    assert all(r.stats.detached == 0 for r in results) and asked


def test_a_sampled_deep_auto_tree_without_its_last_forward_follows_the_target(models, prompt_ids, monkeypatch):
    """A sampled deep-auto tree whose last place keeps its siblings as leaves (the forward not
    taken) crosses the workers and still follows the target: the first two tokens of 1,500 seeded
    requests (async, interleaved at random, the short prompt) against the target's marginals."""
    asked = last_forward_rule(monkeypatch, "never")
    prompt = prompt_ids["short"]
    pair = make_pair(models, "async", Seeded(12))
    policy = PolicyConfig(name="svip", threshold=0.3, tree="deep-auto")  # blocks SVIP ends before their cap
    requests = [GenerationRequest(prompt, 3, dataclasses.replace(PLAIN, seed=s), policy) for s in range(1500)]
    results = [r for i in range(0, len(requests), 50) for r in pair.generate_all(requests[i:i + 50])]
    assert all(r.stats.detached == 0 for r in results) and asked
    assert sum(r.stats.branches for r in results) > 0  # siblings were taken
    assert_first_tokens_follow_the_target(models, prompt, PLAIN, results)


def test_a_seeded_sampled_tree_across_the_workers_reproduces(models, prompt_ids):
    """Every draw of a sampled tree's round is keyed by (seed, place, purpose), on either worker:
    the same requests give the same tokens again, one at a time and batched."""
    policy = PolicyConfig(name="svip", threshold=0.6, tree="cape")
    requests = [GenerationRequest(ids, 24, SamplingParams(temperature=0.9, seed=7 + i), policy)
                for i, ids in enumerate(prompt_ids.values())]
    one = [make_pair(models, "sync").generate(r) for r in requests]
    assert sum(r.stats.tree_nodes for r in one) > sum(r.stats.draft_tokens for r in one)  # trees were drafted
    assert [r.token_ids for r in one] == [r.token_ids for r in make_pair(models, "sync").generate_all(requests)]
