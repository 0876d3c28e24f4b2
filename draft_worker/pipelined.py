"""The draft side of one distributed session: what to draft next, given the coordinator's
feedback. Pure protocol logic over a DraftSession; the gRPC service (service.py) wraps it.

In async mode the draft stays one block ahead: after sending block k it writes block k+1 on the
assumption that k is fully accepted (and says so with ``followup``). A rejection rolls the cache
back to the settled prefix, adopts the coordinator's new epoch and drafts from the correction.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from draft_worker.drafter import DraftSession
from svip_common.contracts import NO_TOKEN, Block
from svip_common.errors import InvalidRequest


@dataclass
class Outgoing:
    block: Block
    followup: bool
    resolved_token: int = NO_TOKEN
    started_at: float = 0.0
    finished_at: float = 0.0


@dataclass
class PipelinedDraft:
    session: DraftSession
    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    pipelined: bool  # async: stay one block ahead
    known: list[int] = field(default_factory=list)  # committed, as settled by the coordinator
    epoch: int = 0
    outstanding: list[Outgoing] = field(default_factory=list)  # sent, not yet answered (<= 2)

    @property
    def cached_tokens(self) -> int:
        return self.session.cached_tokens

    def __post_init__(self):
        self.known = list(self.prompt)
        self.limit = len(self.prompt) + self.max_new_tokens

    def start(self) -> Iterator[Outgoing]:
        return self._draft_ahead()

    def on_feedback(self, epoch: int, base: int, drafted: int, accepted: int, token: int, p_row) -> Iterator[Outgoing]:
        """Apply the verdict on the oldest outstanding block (checked at once), then draft what
        comes next, block by block as the returned iterator is advanced."""
        if not self.outstanding or self.outstanding[0].block.base != base or len(self.outstanding[0].block) != drafted:
            raise InvalidRequest(f"feedback for a block at base {base} of {drafted} tokens that this session did not send")
        if accepted > drafted:
            raise InvalidRequest(f"feedback accepts {accepted} of {drafted} tokens")
        answered = self.outstanding.pop(0)
        block = answered.block
        self.session.feedback(drafted, accepted)
        if accepted == drafted and token == NO_TOKEN:
            if not answered.followup:
                raise InvalidRequest("deferred feedback for a block that has no follow-up")
            self.known += block.tokens  # the follow-up block, already sent, resolves what comes next
            return self._draft_ahead()
        resolved = NO_TOKEN
        if token == NO_TOKEN:
            if p_row is None or block.q_rows is None:
                raise InvalidRequest("a sampled rejection needs the target's p row")
            token = resolved = self.session.resolve_correction(block, accepted, p_row)
        self.known = self.known[:base] + block.tokens[:accepted] + [token]
        self.epoch = epoch
        self.outstanding.clear()
        return self._draft_ahead(resolved)

    def _draft_ahead(self, resolved_token: int = NO_TOKEN) -> Iterator[Outgoing]:
        """Draft the next block after everything known or outstanding, and in async mode the one
        after it too, while at most one block is unanswered before it."""
        while len(self.outstanding) < (2 if self.pipelined else 1):
            if self.outstanding and not self.outstanding[-1].followup:
                break
            seq = self.known + [t for o in self.outstanding for t in o.block.tokens]
            budget = self.limit - len(seq) - 1  # the verdict's own token fills the last place
            if budget < 1 or (seq and seq[-1] in self.stop_token_ids and len(seq) > len(self.prompt)):
                break
            started = time.time()
            block = self.session.propose(seq, budget)
            if not block.tokens:
                break
            block.epoch = self.epoch
            followup = (
                self.pipelined
                and block.tokens[-1] not in self.stop_token_ids
                and self.limit - (block.base + len(block)) - 1 >= 1
            )
            item = Outgoing(block, followup, resolved_token, started, time.time())
            resolved_token = NO_TOKEN
            self.outstanding.append(item)
            yield item
        if not self.outstanding and (resolved_token != NO_TOKEN or not self._finished()):
            # nothing to draft (budget, or the correction ends the output): an empty block lets
            # the target settle the next position, or at least carries the correction
            now = time.time()
            empty = Block(base=len(self.known), tokens=[], probs=[], entropies=[], epoch=self.epoch)
            item = Outgoing(empty, False, resolved_token, now, now)
            self.outstanding.append(item)
            yield item

    def _finished(self) -> bool:
        ended = len(self.known) > len(self.prompt) and self.known[-1] in self.stop_token_ids
        return ended or len(self.known) >= self.limit
