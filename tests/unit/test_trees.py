"""Token trees (svip_common/trees.py): a tree step through the paged KV pool gives every node the
row a chain through it gives, on both attention paths, and keeping the accepted path leaves the
cache a chain would have."""

from __future__ import annotations

import pytest
import torch

from svip_common.kv_cache import KVPool
from svip_common.trees import (
    ancestors_mask,
    cape_candidates,
    cape_siblings,
    check_grown,
    depths,
    forward_price,
    greedy_path,
    grown_children,
    grows_last_place,
    kept_places,
    node_parents,
    node_paths,
    node_tokens,
    sibling_nodes,
)

PREFIX = [5, 17, 42, 8, 99, 23, 61]
SPINE = [7, 31, 12]
SIBLINGS = [[40], [50, 51], []]  # per place: alternatives to the spine's token there


def test_the_layout_of_a_cape_tree():
    parents = node_parents(len(SPINE), SIBLINGS)
    assert parents == [-1, 0, 1, -1, 0, 0]  # the spine, then 40 at place 0, 50 and 51 at place 1
    assert depths(parents) == [0, 1, 2, 0, 1, 1]
    assert sibling_nodes(len(SPINE), SIBLINGS) == {(0, 40): 3, (1, 50): 4, (1, 51): 5}
    mask = ancestors_mask(parents)
    assert mask[4] == [True, False, False, False, True, False]  # 50 sees the spine's first token and itself
    assert mask[2] == [True, True, True, False, False, False]


GROWN = [(3, 44), (4, 55), (5, 56)]  # deep: 40's child 44, 50's child 55, 51's child 56


def test_the_layout_of_a_deep_tree_and_the_path_greedy_takes():
    parents = node_parents(len(SPINE), SIBLINGS, GROWN)
    assert parents == [-1, 0, 1, -1, 0, 0, 3, 4, 5]
    assert depths(parents)[6:] == [1, 2, 2]  # each grown node a place past its sibling
    assert node_tokens(SPINE, SIBLINGS, GROWN) == [7, 31, 12, 40, 50, 51, 44, 55, 56]
    assert node_paths(SPINE, SIBLINGS, GROWN)[7] == (7, 50, 55)
    tokens = node_tokens(SPINE, SIBLINGS, GROWN)

    def choices(*taken):  # the target's choice at each row (before the block, then each node): these along a path
        out = [0] * (1 + len(tokens))
        for at, token in taken:
            out[1 + at] = token
        return out

    assert greedy_path(parents, tokens, choices((-1, 7), (0, 31), (1, 12))) == [0, 1, 2]  # the spine, whole
    assert greedy_path(parents, tokens, choices((-1, 7), (0, 50), (4, 55))) == [0, 4, 7]  # a sibling, its child
    assert greedy_path(parents, tokens, choices((-1, 7), (0, 51), (5, 99))) == [0, 5]  # its child not the choice
    assert greedy_path(parents, tokens, choices((-1, 40), (3, 44))) == [3, 6]  # off the spine at the first place
    assert greedy_path(parents, tokens, choices((-1, 99))) == []


def test_grown_nodes_are_checked_and_kept_by_what_their_path_pays():
    assert check_grown(len(SPINE), SIBLINGS, GROWN) is None
    assert "not a node off the spine" in check_grown(len(SPINE), SIBLINGS, [(2, 9)])
    assert "repeats token 9 under node 3" in check_grown(len(SPINE), SIBLINGS, [(3, 9), (3, 9)])
    ranked = [(9, 0.5), (8, 0.3)]
    assert grown_children(ranked, reach=1.0, price=0.0, room=5) == [9]  # its most likely child
    assert grown_children(ranked, reach=0.3, price=0.2, room=5) == []  # 0.15 does not pay 0.2
    assert grown_children(ranked, reach=0.5, price=0.2, room=5) == [9]  # 0.25 pays 0.2
    assert grown_children(ranked, reach=1.0, price=0.0, room=0) == []


def test_the_last_places_own_forward_grows_where_its_children_pay_its_price():
    assert forward_price(rate=200.0, forward_s=0.005) == pytest.approx(1.0)  # a forward delays a token's worth
    assert grows_last_place([0.3, 0.2], acceptance=0.8, price=0.0)  # free: it grows
    assert grows_last_place([0.3, 0.2], acceptance=0.8, price=0.39)  # 0.5 x 0.8 = 0.4 pays 0.39
    assert not grows_last_place([0.3, 0.2], acceptance=0.8, price=0.41)
    assert not grows_last_place([], acceptance=1.0, price=0.01)  # no sibling there: nothing to grow


def test_a_taken_up_continuation_keeps_the_places_past_its_stop_that_pay_their_nodes():
    """kept_places: never fewer than the places up to the policy's stop; past it, each place while
    the draft's chance it settles a token (the spine's chance up to it, times its token's q plus
    its siblings') is above its nodes at the price; free (0), all of them."""
    probs, mass, counts = [0.9, 0.5, 0.8, 0.5], [0.05, 0.3, 0.1, 0.2], [1, 3, 1, 2]
    assert kept_places(probs, mass, counts, 1, 0.0) == 4
    assert kept_places(probs, mass, counts, 1, 1e9) == 1
    # place 1: 0.9 x (0.5 + 0.3) = 0.72 over 4 nodes; place 2: 0.45 x 0.9 = 0.405 over 2; place 3: 0.36 x 0.7
    # = 0.252 over 3
    assert kept_places(probs, mass, counts, 1, 0.17) == 3 and kept_places(probs, mass, counts, 1, 0.19) == 1
    assert kept_places(probs, mass, counts, 1, 0.2) == 1 and kept_places(probs, mass, counts, 2, 0.2) == 3
    assert kept_places(probs, [0.0] * 4, [0] * 4, 4, 1e9) == 4  # nothing past the stop to price


@pytest.mark.parametrize("p, kept", [(0.1, 8), (0.29, 8), (0.3, 6), (0.59, 6), (0.6, 4), (0.79, 4), (0.8, 2), (1.0, 2)])
def test_cape_keeps_more_candidates_where_the_draft_is_less_sure(p, kept):
    assert cape_candidates(p) == kept
    ranked = [(t, 0.01) for t in range(100, 110)]
    assert cape_siblings(p, ranked, room=64) == list(range(100, 100 + kept - 1))
    assert cape_siblings(p, ranked, room=1) == [100]  # the node budget bounds it


def _chain_rows(model, tokens: list[int], last: int) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -last:]


@pytest.mark.parametrize("flat", [True, False], ids=["flat decoder", "model modules"])
@torch.inference_mode()
def test_a_tree_steps_rows_are_what_chains_through_each_node_give(models, flat):
    model = models["target"].model
    pool = KVPool(model, tokens=256, page_size=4, flat=flat)
    seq, other = pool.sequence(), pool.sequence()
    seq.forward(PREFIX, 1)
    nodes = SPINE + [t for options in SIBLINGS for t in options]
    parents = node_parents(len(SPINE), SIBLINGS)
    rows, beside = pool.forward([(seq, nodes, len(nodes), parents), (other, PREFIX[:3], 1)])
    spine_rows = _chain_rows(model, PREFIX + SPINE, len(SPINE))
    assert torch.allclose(rows[: len(SPINE)], spine_rows, atol=1e-4)
    for (place, token), node in sibling_nodes(len(SPINE), SIBLINGS).items():
        chain = _chain_rows(model, PREFIX + SPINE[:place] + [token], 1)[0]
        assert torch.allclose(rows[node], chain, atol=1e-4), (place, token)
        assert rows[node].argmax() == chain.argmax()
    assert torch.allclose(beside[0], _chain_rows(model, PREFIX[:3], 1)[0], atol=1e-4)  # its neighbour unchanged


@pytest.mark.parametrize("grown, branch, kept", [
    ((), [4], [7, 50]),  # CaPE: 7, then the sibling 50
    ((), [5], [7, 51]),
    (GROWN, [4, 7], [7, 50, 55]),  # deep: 7, then 50 and its child 55
    (GROWN, [3, 6], [40, 44]),  # off the spine at the first place, two deep
], ids=["sibling 50", "sibling 51", "sibling and child", "first place, two deep"])
@torch.inference_mode()
def test_keeping_a_branch_leaves_the_cache_a_chain_through_it_would_hold(models, grown, branch, kept):
    model = models["target"].model
    pool = KVPool(model, tokens=256, page_size=4)
    seq = pool.sequence()
    seq.forward(PREFIX, 1)
    nodes = node_tokens(SPINE, SIBLINGS, grown)
    pool.forward([(seq, nodes, len(nodes), node_parents(len(SPINE), SIBLINGS, grown))])
    accepted = len(kept) - len(branch)
    seq.keep_path(len(PREFIX), len(SPINE), accepted, branch)
    assert seq.tokens == PREFIX + kept
    after = seq.forward([9, 10], 2)
    assert torch.allclose(after, _chain_rows(model, PREFIX + kept + [9, 10], 2), atol=1e-4)
    seq.keep_path(len(PREFIX) + len(kept), 2, 0)  # no branch: the spine is kept as a chain's is
    assert seq.tokens == PREFIX + kept + [9, 10]


@pytest.mark.parametrize("flat", [True, False], ids=["flat decoder", "model modules"])
@torch.inference_mode()
def test_a_tree_packed_with_chains_gives_each_what_it_gets_alone(models, flat, monkeypatch):
    """A tree step attended in one packed call with chain steps of like length (the batched
    engine's usual step): every row as a chain through it, the chains' rows unchanged."""
    from svip_common import kv_cache

    model = models["target"].model
    pool = KVPool(model, tokens=256, page_size=4, flat=flat)
    tree_seq, chain_a, chain_b = pool.sequence(), pool.sequence(), pool.sequence()
    prefix_a, prefix_b = [3, 9, 27, 81, 2, 4, 8], [11, 13, 17, 19, 23, 29]
    pool.forward([(tree_seq, PREFIX, 1), (chain_a, prefix_a, 1), (chain_b, prefix_b, 1)])
    planned = []
    plan = kv_cache._Ragged.plan
    def planning(*args, **kwargs):
        planned.append(plan(*args, **kwargs))
        return planned[-1]

    monkeypatch.setattr(kv_cache._Ragged, "plan", staticmethod(planning))
    nodes = SPINE + [t for options in SIBLINGS for t in options]
    rows, a_rows, b_rows = pool.forward([(tree_seq, nodes, len(nodes), node_parents(len(SPINE), SIBLINGS)),
                                         (chain_a, [5, 6], 2), (chain_b, [7], 1)])
    assert planned[-1].packs and any(pack.explicit is not None for pack in planned[-1].packs)  # packed together
    assert torch.allclose(rows[: len(SPINE)], _chain_rows(model, PREFIX + SPINE, len(SPINE)), atol=1e-4)
    for (place, token), node in sibling_nodes(len(SPINE), SIBLINGS).items():
        assert torch.allclose(rows[node], _chain_rows(model, PREFIX + SPINE[:place] + [token], 1)[0], atol=1e-4)
    assert torch.allclose(a_rows, _chain_rows(model, prefix_a + [5, 6], 2), atol=1e-4)
    assert torch.allclose(b_rows[0], _chain_rows(model, prefix_b + [7], 1)[0], atol=1e-4)
