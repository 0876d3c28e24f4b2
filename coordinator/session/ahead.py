"""Async mode's bookkeeping on the target side: the blocks the draft wrote ahead of the verdict in
flight, waiting here until that verdict says whether they apply. The follow-up (the next block,
should the one in flight be accepted whole) and the prepared continuations (the next block after
a rejection whose correction the draft guessed, keyed by (base, accepted, token)). Every block
dropped unverified counts its tokens as discarded. Decides nothing: SessionPipeline says which
one applies; tests/unit/test_session_pipeline.py drives it without models."""

from __future__ import annotations

from svip_common.contracts import Block, GenerationStats
from svip_common.errors import WorkerError
from svip_common.messages import DraftedBlock, PreparedKey
from svip_common.trees import MAX_TREE_NODES, begins_branch

Waiting = tuple[DraftedBlock, float]  # a block and when it was received


class AheadBlocks:
    def __init__(self, stats: GenerationStats):
        self.stats = stats
        self.followup: Waiting | None = None
        self.prepared: dict[PreparedKey, Waiting] = {}

    def hold_followup(self, block: DraftedBlock, received_at: float) -> None:
        self.followup = (block, received_at)

    def grow(self, more: DraftedBlock) -> bool:
        """More tokens of the follow-up held here, or of the prepared continuation for
        ``more.prepared_for`` (``more.grows``: what it holds already, as the draft sent it); whether
        it still was (else it was verified or dropped: too late). A flat tree's places come with
        their siblings (a tree's block whose places kept none travels as a chain), its nodes
        MAX_TREE_NODES at most with what is held."""
        if more.prepared_for is not None:
            waiting = self.prepared.get(more.prepared_for)
            held = waiting[0] if waiting is not None else None
        else:
            held = self.followup[0] if self.followup is not None else None
        if held is None or held.base != more.base or len(held.tokens) != more.grows:
            return False
        block = held.block
        if bool(block.probs) != bool(more.block.probs):
            raise WorkerError("draft worker grew a block with q(d) where it sent none, or none where it did")
        if more.block.siblings is not None or block.siblings is not None:
            if block.nodes + more.block.nodes > MAX_TREE_NODES:
                raise WorkerError(f"draft worker grew a tree of {block.nodes} nodes by {more.block.nodes}; "
                                  f"the cap is {MAX_TREE_NODES}")
            block.siblings = _places(block) + _places(more.block)
        block.tokens += more.tokens
        block.probs += more.block.probs
        block.entropies += more.block.entropies
        held.followup, held.finished_at = more.followup, more.finished_at
        return True

    def followup_on(self, block: DraftedBlock) -> tuple[int, ...]:
        """The follow-up's tokens as held now, if it was drafted on ``block`` accepted whole (else
        none): what the block's forward may feed after it (Verifier.verify_batch's lookahead)."""
        held = self.followup[0] if self.followup is not None else None
        if held is None or held.epoch != block.epoch or held.base != block.base + len(block.tokens):
            return ()
        return tuple(held.tokens)

    def take_followup(self) -> Waiting | None:
        """The follow-up, for verification next (the block before it was accepted whole)."""
        followup, self.followup = self.followup, None
        return followup

    def drop_followup(self) -> None:
        if self.followup is not None:
            self.stats.discarded_tokens += len(self.followup[0].tokens)
            self.followup = None

    def keep_prepared(self, key: PreparedKey, block: DraftedBlock, received_at: float) -> None:
        self.prepared[key] = (block, received_at)
        self.stats.prepared_sent += 1

    def take_prepared(self, base: int, accepted: int, token: int, branch: tuple[int, ...] = ()) -> Waiting | None:
        """The prepared continuation that assumed this verdict, if the draft wrote one: after the
        token settled at the rejected place, or after a tree's sibling taken there (branch) if
        it begins with the nodes the branch took below the sibling."""
        key = (base, accepted, branch[0] if branch else token)
        waiting = self.prepared.get(key)
        if waiting is None or not begins_branch(waiting[0].tokens, branch):
            return None
        return self.prepared.pop(key)

    def drop_prepared(self, base: int | None = None) -> None:
        """Forget the prepared continuations of the block at ``base`` (None: all of them)."""
        for key in [key for key in self.prepared if base is None or key[0] == base]:
            self.stats.discarded_tokens += len(self.prepared.pop(key)[0].tokens)

    def drop_all(self) -> None:
        self.drop_followup()
        self.drop_prepared()


def _places(block: Block) -> list[list[int]]:
    """A block's siblings place by place (a chain's: none at each)."""
    return block.siblings if block.siblings is not None else [[] for _ in block.tokens]
