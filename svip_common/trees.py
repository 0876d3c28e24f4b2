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

Tree "deep" grows the tree a level below the siblings, as EAGLE-2's trees grow past the first
level (Li et al. 2024): each sibling gets the draft's most likely next token after it, its
*grown* child. A sibling's row comes from the draft's next forward, which takes it beside the
spine's next token (both children of the last cached token: tokens, no extra forward); the last
place's siblings, whose spine is done, get a forward of their own. "deep-auto" keeps of those
nodes, as "auto" keeps siblings, the ones whose path's probability under the draft (the reach to
the sibling's place, times q of the sibling, times q of the child) pays for its verification at
the target's load. Measured on the embedded pair: each sibling's top child settles most of what
its top three do (2.79 against 2.83 tokens a round) at half the nodes, and the last place's
children settle nearly all of it (SVIP stops where the draft is unsure: where siblings are taken).
Where the target takes a sibling, the walk goes on into its children: a round can then settle
two tokens past the rejected place, not one. A child below a sibling is not drafted by sampling:
greedy takes it where it is the target's own choice; sampled, it is tried as a sibling is
(branch_sampled), against the target's p at the sibling's row, so every place still follows the
target's distribution.

Layout of a tree block's nodes in the verifier's forward: the spine in order, then each place's
siblings in place order, then the grown nodes, each after its parent. ``parents`` gives each
node's parent among them (-1: the token before the block); a node's position is the block's base
plus its depth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from svip_common.errors import InvalidRequest

TREES = ("off", "cape", "auto", "deep", "deep-auto")
CAPE_BINS = ((0.3, 8), (0.6, 6), (0.8, 4))  # (top-1 probability under, candidates kept)
CAPE_WIDEST = 8  # candidates at a place when the draft is least sure
MAX_TREE_NODES = 64  # a block's nodes at most (spine, siblings, grown): a request cannot make a step wider
GROWN_WIDEST = 1  # deep trees: a sibling's children at most
# a sampled tree carries its q rows to the target (each spine place's, float32 over the vocabulary):
# at most this many bytes a block, so its spine holds at most MAX_Q_BYTES // (4 * width) places
# (6 at a 152k vocabulary: 37 MiB and 144 ms of the target's compute thread a block before, review H-3)
MAX_Q_BYTES = 4 << 20
MAX_NODE_PRICE = 1e6  # a node's price in tokens beyond any load (above 1, no sibling pays): the wire's bound


def q_rows_within(width: int) -> int:
    """The spine places whose q rows (dense float32, the worst case) fit MAX_Q_BYTES at this width."""
    return max(1, MAX_Q_BYTES // (4 * width))


def priced(tree: str) -> bool:
    """Whether the tree's width is priced at the target's load (``node_price``)."""
    return tree in ("auto", "deep-auto")


def grows(tree: str) -> bool:
    """Whether the tree grows nodes below its siblings (their rows from the draft's forwards)."""
    return tree in ("deep", "deep-auto")


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


def check_grown(spine: int, siblings: Sequence[Sequence[int]], grown: Sequence[tuple[int, int]]) -> str | None:
    """What is wrong with a block's grown nodes, or None: each (parent, token) a child of a node
    off the spine laid before it, no token twice among one node's children, the block's nodes at
    most MAX_TREE_NODES."""
    first = spine + sum(map(len, siblings))
    if first + len(grown) > MAX_TREE_NODES:
        return f"a tree of {first + len(grown)} nodes; the cap is {MAX_TREE_NODES}"
    seen = set()
    for at, (parent, token) in enumerate(grown, start=first):
        if not spine <= parent < at:
            return f"grown node {at} has parent {parent}, not a node off the spine laid before it"
        if (parent, token) in seen:
            return f"grown node {at} repeats token {token} under node {parent}"
        seen.add((parent, token))
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


def kept_places(probs: Sequence[float], sibling_mass: Sequence[float], sibling_counts: Sequence[int], first: int,
                price: float) -> int:
    """How many places a continuation taken up past a sibling keeps, having drafted on past its
    policy's stop after ``first`` places: those, then each next place while the draft's chance
    that it settles a token (that the spine holds up to it, times its token's q plus its siblings'
    ``sibling_mass``) is above what its nodes cost (its token and ``sibling_counts`` siblings, a row
    each, at ``price``: node_price; 0, free, keeps them all)."""
    reach, end = math.prod(probs[:first]), first
    while end < len(probs) and reach * (probs[end] + sibling_mass[end]) > price * (1 + sibling_counts[end]):
        reach *= probs[end]
        end += 1
    return end


def node_price(plain_rate: float, verify_token_s: float) -> float:
    """What verifying one more node costs, in tokens: the seconds it adds to the target's step
    times the tokens the target alone makes per second at its batch (every session in the step
    waits for it). Siblings come from the draft's forward for the spine: no draft work of their own."""
    return plain_rate * verify_token_s


def forward_price(rate: float, forward_s: float) -> float:
    """What a draft forward of a deep tree's block's own costs, in tokens: the seconds it delays the
    block (its verification waits for it) times the tokens a second the block's session makes."""
    return rate * forward_s


def grows_last_place(reaches: Sequence[float], acceptance: float, price: float) -> bool:
    """Deep trees under "deep-auto": whether the last place's siblings take a draft forward of their
    own for their children (the spine is done: nothing else rides in it). A child adds a token
    only where the target takes its sibling (the sum of their paths' probabilities under the
    draft: ``reaches``) and then accepts it (``acceptance``: the session's share of drafted tokens
    accepted so far), so the forward pays if that is above its ``price`` (``forward_price``; 0:
    free, every deep tree grows). Measured across the workers, a forward of
    the 8B draft on its own H100 or of the 1B on its own costs a block more than its last place's
    children bring (docs/benchmarks.md, deep trees priced by their last forward)."""
    return price <= 0.0 or sum(reaches) * acceptance > price


def grown_children(ranked: Sequence[tuple[int, float]], reach: float, price: float, room: int) -> list[int]:
    """Deep trees: a sibling's children, from its row's most likely tokens (ranked, with q),
    where the sibling's path had probability ``reach`` under the draft: those whose path pays at
    ``price`` (reach times q above it), GROWN_WIDEST at most, and no more than ``room``."""
    return [token for token, q in ranked[: min(GROWN_WIDEST, max(room, 0))] if reach * q > price]


def begins_branch(tokens: Sequence[int], branch: Sequence[int]) -> bool:
    """Whether a continuation prepared after a branch's sibling (branch[0]), whose first tokens
    are ``tokens``, begins with the nodes the branch took below that sibling (it then serves the
    branch: the draft chose them after the sibling, as it chose the continuation); no branch: yes."""
    return not branch or list(tokens[: len(branch) - 1]) == list(branch[1:])


def node_parents(spine: int, siblings: Sequence[Sequence[int]] | None,
                 grown: Sequence[tuple[int, int]] | None = None) -> list[int]:
    """Each node's parent among the nodes (-1: the token before the block), in the layout above."""
    parents = [i - 1 for i in range(spine)]
    for place, options in enumerate(siblings or ()):
        parents += [place - 1] * len(options)
    return parents + [parent for parent, _ in grown or ()]


def node_tokens(tokens: Sequence[int], siblings: Sequence[Sequence[int]] | None,
                grown: Sequence[tuple[int, int]] | None = None) -> list[int]:
    """Every node's token, in the layout above."""
    return [*tokens, *(t for options in siblings or () for t in options), *(t for _, t in grown or ())]


def node_paths(tokens: Sequence[int], siblings: Sequence[Sequence[int]] | None,
               grown: Sequence[tuple[int, int]] | None = None) -> list[tuple[int, ...]]:
    """Each node's path: the tokens from the block's first place through the node's own."""
    parents = node_parents(len(tokens), siblings, grown)
    paths: list[tuple[int, ...]] = []
    for parent, token in zip(parents, node_tokens(tokens, siblings, grown)):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return paths


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """Each node's children among the nodes, in layout order (-1: the token before the block)."""
    out: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        out.setdefault(parent, []).append(node)
    return out


def greedy_path(parents: Sequence[int], tokens: Sequence[int], choices: Sequence[int]) -> list[int]:
    """The nodes greedy verification takes: from the token before the block, while the last node
    taken has a child whose token is the target's choice at that node's row (choices: the row
    before the block, then one per node), that child. The spine's nodes come first, then the
    branch off it; output equals the target alone's, as each node taken is its own choice."""
    children, path, at = children_of(parents), [], -1
    while True:
        node = next((n for n in children.get(at, ()) if tokens[n] == choices[1 + at]), None)
        if node is None:
            return path
        path.append(node)
        at = node


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
