"""Token trees in the in-process engine (issue 44): greedy output equals the target decoding alone,
token for token, with CaPE's trees and with `auto`'s priced ones, one request at a time and
batched; a sibling does cover rejections (a round settles one token more there); an unknown tree
is refused by name. Trees across the workers: tests/integration/test_trees_wire.py; a feature
head's tree, refused by name: tests/integration/test_feature_draft.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from coordinator.engine import SpeculativeEngine
from draft_worker.drafter import Drafter
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.trees import MAX_TREE_NODES, node_paths
from tests.policies import TREE_POLICIES

MAX_NEW = 40


@pytest.fixture(scope="module")
def alone(models, prompt_ids):
    engine = SpeculativeEngine(models["target"], None)
    return {name: engine.generate(GenerationRequest(ids, MAX_NEW)).token_ids for name, ids in prompt_ids.items()}


@pytest.mark.parametrize("draft_name", ["random_draft", "close_draft"])
@pytest.mark.parametrize("policy", list(TREE_POLICIES))
def test_a_tree_settles_what_the_target_alone_settles(models, prompt_ids, alone, draft_name, policy):
    engine = SpeculativeEngine(models["target"], models[draft_name], load_aware="off")
    for name, ids in prompt_ids.items():
        result = engine.generate(GenerationRequest(ids, MAX_NEW, policy=TREE_POLICIES[policy]))
        assert result.token_ids == alone[name], (policy, draft_name, name)
        assert result.stats.tree_nodes >= result.stats.draft_tokens  # the spine's tokens are nodes too
        assert result.stats.target_forwards == result.stats.rounds  # one forward a round, the tree whole


def test_siblings_cover_rejections_and_each_settles_one_more_token(models, prompt_ids, alone):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    chain = PolicyConfig(name="constant", draft_length=3)
    tree = dataclasses.replace(chain, tree="cape")
    settled = {"off": 0, "cape": 0}
    rounds = {"off": 0, "cape": 0}
    branches = 0
    for ids in prompt_ids.values():
        for name, policy in (("off", chain), ("cape", tree)):
            result = engine.generate(GenerationRequest(ids, MAX_NEW, policy=policy))
            settled[name] += len(result.token_ids)
            rounds[name] += result.stats.rounds
            branches += result.stats.branches
    assert branches > 0
    assert settled["cape"] / rounds["cape"] > settled["off"] / rounds["off"]  # more per round, same tokens


def test_nodes_grown_below_siblings_settle_a_place_further(models, prompt_ids, alone):
    """tree deep: where the target takes a sibling and then a child grown below it, the round
    settles both and the target's token after them (a verdict's branch of two tokens), and the
    output is still the target's alone. (Tokens a round, deep against CaPE on the embedded pair:
    docs/benchmarks.md; this pair's close draft seldom has a rejection its sibling covers.)"""
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    policy = PolicyConfig(name="constant", draft_length=3, tree="deep")
    deeper, grown = 0, 0
    for name, ids in prompt_ids.items():
        rounds = []
        result = engine.generate(GenerationRequest(ids, MAX_NEW, policy=policy),
                                 on_round=lambda block, verdict, settled: rounds.append((block, verdict, settled)))
        assert result.token_ids == alone[name]
        for block, verdict, settled in rounds:
            grown += len(block.grown or ())
            if len(verdict.branch) == 2:
                deeper += 1
                assert settled[verdict.accepted : verdict.accepted + 3] == [*verdict.branch, verdict.token][:3]
        assert result.stats.branch_tokens == sum(len(verdict.branch) for _, verdict, _ in rounds)
    assert grown > 0 and deeper > 0


@torch.inference_mode()
def test_each_grown_child_is_the_drafts_own_next_token_after_its_sibling(models, prompt_ids):
    """A deep tree's children come from rows computed beside the spine's next token (siblings of
    earlier places) or in a forward of their own (the last place's): each is the draft's most
    likely token after its sibling's path, as a plain forward of that path gives it."""
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    draft = models["close_draft"].model
    places = set()
    for ids in prompt_ids.values():
        rounds = []
        engine.generate(GenerationRequest(ids, 24, policy=PolicyConfig(name="constant", draft_length=4, tree="deep")),
                        on_round=lambda block, verdict, settled: rounds.append((block, settled)))
        committed = list(ids)
        for block, settled in rounds:
            paths = node_paths(block.tokens, block.siblings, block.grown)
            for parent, child in block.grown or ():
                row = draft(input_ids=torch.tensor([committed + list(paths[parent])])).logits[0, -1]
                assert child == int(row[: models["target"].vocab_size].argmax())
                places.add(len(paths[parent]) == len(block.tokens))  # True: the last place's sibling
            committed += settled
    assert places == {True, False}  # both ways of growing were seen


@pytest.mark.parametrize("price", [0.0, 1e9])
def test_deep_auto_grows_the_last_places_children_only_where_their_forward_pays(models, prompt_ids, price):
    """deep-auto: the last place's siblings take a draft forward of their own for their children
    only where the chance a child settles a token is above that forward's price
    (trees.grows_last_place). Free, they grow in one forward more than the spine's; at a price no
    child pays, the last place keeps its siblings as leaves and the block takes a forward per
    spine token. Children below earlier places ride the spine's forwards either way."""
    drafter = Drafter(models["close_draft"], models["target"].vocab_size)
    policy = PolicyConfig(name="svip", threshold=0.6, tree="deep-auto")  # a block SVIP ends, not its cap
    last_siblings = last_grown = 0
    for ids in prompt_ids.values():
        session = drafter.open(SamplingParams(), policy, ())
        session.forward_price = price
        draft = session.begin(list(ids), 40)
        while not draft.done:
            drafter.step([draft])
        block, spine = draft.block, len(draft.block.tokens)
        paths = node_paths(block.tokens, block.siblings, block.grown)
        grown = sum(len(paths[parent]) == spine for parent, _ in block.grown or ())  # below the last place
        last_siblings += bool(block.siblings[-1])
        last_grown += grown
        assert session.forwards == spine + (1 if grown else 0)
        session.close()
    assert last_siblings > 0
    assert (last_grown > 0) == (price == 0.0)


def last_forward_rule(monkeypatch, rule: str) -> list:
    """deep-auto's last forward (trees.grows_last_place) as priced, or never taken; the prices it
    was asked at (where the last place had siblings to grow)."""
    from draft_worker import drafter

    asked, real = [], drafter.grows_last_place

    def grows(reaches, acceptance, price):
        asked.append(price)
        return real(reaches, acceptance, price) if rule == "priced" else False

    monkeypatch.setattr(drafter, "grows_last_place", grows)
    return asked


@pytest.mark.parametrize("rule", ["priced", "never"])
def test_deep_auto_settles_what_the_target_alone_settles_where_its_last_forward_is_skipped(
        models, prompt_ids, alone, monkeypatch, rule):
    """deep-auto under SVIP (blocks end before their cap, so their last place has siblings to
    grow): greedy output equals the target alone's, one request at a time and batched, with the
    last forward priced at the load and with it never taken (those siblings stay leaves)."""
    asked = last_forward_rule(monkeypatch, rule)
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    policy = PolicyConfig(name="svip", threshold=0.6, tree="deep-auto")
    names = list(prompt_ids)
    requests = [GenerationRequest(prompt_ids[name], MAX_NEW, policy=policy) for name in names]
    for request, name in zip(requests, names):
        assert engine.generate(request).token_ids == alone[name], (rule, name)
    for result, name in zip(engine.generate_many(requests, batch_size=len(requests)), names):
        assert result.token_ids == alone[name], (rule, name)
    assert asked and (rule == "never" or any(price > 0 for price in asked))  # the rule was asked, at a price


@pytest.mark.parametrize("tree", ["cape", "auto", "deep"])
def test_batched_trees_equal_one_at_a_time(models, prompt_ids, alone, tree):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    policy = PolicyConfig(name="svip", threshold=0.6, tree=tree)
    names = list(prompt_ids)
    requests = [GenerationRequest(prompt_ids[name], MAX_NEW, policy=policy) for name in names]
    for result, name in zip(engine.generate_many(requests, batch_size=len(requests)), names):
        assert result.token_ids == alone[name], name


def test_trees_chains_and_sampled_trees_in_one_batch_equal_each_alone(models, prompt_ids):
    """One batched step verifies a CaPE tree, a priced tree, a chain and a sampled tree side by side
    (packed together where their lengths allow): each request's output is what it makes alone."""
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    policies = [PolicyConfig(name="svip", threshold=0.6, tree="cape"), PolicyConfig(name="svip", threshold=0.6),
                PolicyConfig(name="constant", draft_length=3, tree="auto"), PolicyConfig(name="svip", tree="cape"),
                PolicyConfig(name="constant", draft_length=3, tree="deep"), PolicyConfig(name="svip", tree="deep")]
    samplings = [SamplingParams(), SamplingParams(), SamplingParams(), SamplingParams(temperature=0.9, seed=3),
                 SamplingParams(), SamplingParams(temperature=0.9, seed=4)]
    requests = [GenerationRequest(ids, MAX_NEW, sampling, policy)
                for ids in prompt_ids.values() for sampling, policy in zip(samplings, policies)]
    alone = [engine.generate(r).token_ids for r in requests]
    assert [r.token_ids for r in engine.generate_many(requests, len(requests))] == alone


@pytest.mark.parametrize("tree", ["cape", "deep"])
def test_a_trees_nodes_are_bounded_whatever_the_request(models, prompt_ids, tree):
    # unsure everywhere: the widest trees
    engine = SpeculativeEngine(models["target"], models["random_draft"], load_aware="off")
    policy = PolicyConfig(name="constant", draft_length=40, max_draft_length=40, tree=tree)
    seen = []
    request = GenerationRequest(prompt_ids["short"], 60, policy=policy)
    engine.generate(request, on_round=lambda block, verdict, settled: seen.append(block.nodes))
    assert seen and max(seen) <= MAX_TREE_NODES


def test_an_unknown_tree_is_refused_by_name(models, prompt_ids):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    with pytest.raises(InvalidRequest, match="unknown tree 'deepest'"):
        engine.generate(GenerationRequest(prompt_ids["short"], 8, policy=PolicyConfig(name="svip", tree="deepest")))


@pytest.mark.parametrize("tree", ["cape", "deep"])
def test_a_seeded_sampled_tree_reproduces_one_at_a_time_and_batched(models, prompt_ids, tree):
    """Every draw of a tree's round is keyed by (seed, place, purpose): the siblings' coins too."""
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    policy = PolicyConfig(name="svip", threshold=0.6, tree=tree)
    requests = [GenerationRequest(ids, 24, SamplingParams(temperature=0.9, seed=7 + i), policy)
                for i, ids in enumerate(prompt_ids.values())]
    one = [engine.generate(r) for r in requests]
    assert [r.token_ids for r in one] == [engine.generate(r).token_ids for r in requests]
    assert [r.token_ids for r in one] == [r.token_ids for r in engine.generate_many(requests, len(requests))]
