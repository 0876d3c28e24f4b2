"""Token trees (issue 44), the CaPE shape: a block's drafted tokens are its *spine* (the draft's
own choice at each place, SVIP's stop deciding how deep it goes) and, at each place, *siblings*:
the draft's next most likely tokens there, leaves off the spine. The target verifies every node in
one forward, each attending to its ancestors only (the paged KV pool's tree steps,
svip_common/kv_cache.py), so a node's row is what a chain through that node would compute there.

Greedy acceptance walks the spine as a chain does; at the first place where the target's choice
differs from the spine's token, a sibling equal to that choice is taken (its *branch*), and the
row of that sibling gives the next place's token. So a round settles the chain's tokens, and one
more wherever a sibling covered the rejection; every settled token is still the target's own
choice, and output equals the target alone's token for token. Sampled, the spine is judged by the
chain's rejection rule; at a rejected place the siblings are tried in order against the residual
max(0, p - q), each taken with its probability under what is left of it
(svip_common/rejection.py, branch_sampled), so every place still follows the target's distribution.

CaPE's width (GliDe with CaPE, Du et al. 2024; the bins of its public code): the candidates kept
at a drafted place, the spine's token among them, by the draft's probability of that token:
8 under 0.3, 6 under 0.6, 4 under 0.8, else 2. Siblings are those less the spine's own. Tree
"auto" keeps of them those that pay at the target's measured load (``node_price``): where
verification is memory-bound (a GPU at small batches) a node costs almost nothing and CaPE's width
stays; where it is compute-bound (this CPU, large batches) the tree shrinks toward the chain.

Layout of a tree block's nodes in the verifier's forward: the spine in order, then each place's
siblings in place order. ``parents`` gives each node's parent among them (-1: the token before
the block); a node's position is the block's base plus its depth.
"""

from __future__ import annotations

from collections.abc import Sequence

from svip_common.errors import InvalidRequest

TREES = ("off", "cape", "auto")
CAPE_BINS = ((0.3, 8), (0.6, 6), (0.8, 4))  # (top-1 probability under, candidates kept)
CAPE_WIDEST = 8  # candidates at a place when the draft is least sure
MAX_TREE_NODES = 64  # a block's nodes at most (spine and siblings): a request cannot make a step wider
MAX_NODE_PRICE = 1e6  # a node's price in tokens beyond any load (above 1, no sibling pays): the wire's bound


def check_tree(tree: str) -> None:
    if tree not in TREES:
        raise InvalidRequest(f"unknown tree {tree!r}; choose one of {', '.join(TREES)}")


def check_siblings(tokens: Sequence[int], siblings: Sequence[Sequence[int]]) -> str | None:
    """What is wrong with a block's siblings, or None: one list per drafted place, at most
    MAX_TREE_NODES nodes with the spine, none equal to its place's drafted token or repeated there
    (a repeated id would be verified twice and could be taken twice)."""
    if len(siblings) != len(tokens):
        return f"{len(siblings)} lists of siblings for {len(tokens)} drafted tokens"
    nodes = len(tokens) + sum(map(len, siblings))
    if nodes > MAX_TREE_NODES:
        return f"a tree of {nodes} nodes; the cap is {MAX_TREE_NODES}"
    for place, (token, options) in enumerate(zip(tokens, siblings)):
        if token in options or len(set(options)) != len(options):
            return f"siblings at place {place} repeat a token there"
    return None


def cape_candidates(top_prob: float) -> int:
    """How many candidates CaPE keeps at a place where the draft gave its token top_prob."""
    return next((kept for under, kept in CAPE_BINS if top_prob < under), 2)


def cape_siblings(token_prob: float, ranked: Sequence[tuple[int, float]], room: int, reach: float = 1.0,
                  price: float = 0.0) -> list[int]:
    """The siblings at a drafted place: the runners-up (ranked, the spine's token not among them)
    that CaPE keeps at the draft's probability of its token, no more than ``room``; with a price
    (tree "auto"), only those whose chance of settling a token pays for their verification:
    reach (the draft's chance that the spine holds up to this place) times q(sibling) above the
    price of a verified node, in tokens the target alone makes meanwhile (``node_price``)."""
    kept = ranked[: min(cape_candidates(token_prob) - 1, max(room, 0))]
    return [token for token, q in kept if reach * q > price]


def node_price(plain_rate: float, verify_token_s: float) -> float:
    """What verifying one more node costs, in tokens: the seconds it adds to the target's step
    times the tokens the target alone makes per second at its batch (every session in the step
    waits for it). Siblings come from the draft's forward for the spine: no draft work of their own."""
    return plain_rate * verify_token_s


def node_parents(spine: int, siblings: Sequence[Sequence[int]]) -> list[int]:
    """Each node's parent among the nodes (-1: the token before the block), in the layout above."""
    parents = [i - 1 for i in range(spine)]
    for place, options in enumerate(siblings):
        parents += [place - 1] * len(options)
    return parents


def sibling_nodes(spine: int, siblings: Sequence[Sequence[int]]) -> dict[tuple[int, int], int]:
    """(place, token) -> the node index of that sibling."""
    nodes, at = {}, spine
    for place, options in enumerate(siblings):
        for token in options:
            nodes.setdefault((place, token), at)
            at += 1
    return nodes


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (0: a child of the token before the block); parents come before children."""
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


def ancestors_mask(parents: Sequence[int]) -> list[list[bool]]:
    """[node][node]: whether the column node is the row node or one of its ancestors."""
    rows: list[list[bool]] = []
    for i, parent in enumerate(parents):
        row = list(rows[parent]) if parent >= 0 else [False] * len(parents)
        row[i] = True
        rows.append(row)
    return rows
