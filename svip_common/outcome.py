"""What a verdict makes of the draft's line, decided once, on the target, and carried whole in
its feedback (svip_common/messages.py ``Feedback.outcome``); the draft applies it
(draft_worker/pipelined.py) and derives nothing again.

A verdict on a block at ``base`` of ``drafted`` tokens accepts ``accepted`` of them (a tree may
take ``branch``, its nodes off the spine from the rejected place on); then one of four things comes
next (``next``):

- FOLLOWUP: the whole block was accepted, and the follow-up drafted on it settles the next place
  (its first token is judged by the target's stored row): nothing is settled here, the draft's line
  goes on. A greedy chain's follow-up grows at the target until it is verified: ``next_tokens``
  says how many of its tokens had arrived (the rest, drafted meanwhile, start the next follow-up).
  So may a prepared continuation sent before it ended: ``next_tokens`` says how many it verifies.
- PREPARED: a rejection whose continuation the draft prepared for ``token`` (or for the branch's
  sibling) is verified next with no round trip: the draft takes that block up as its outstanding one.
- DRAW: a sampled rejection whose correction the draft draws from the target's p row (the block's
  q rows stayed with the draft).
- SETTLED: the target settled ``token`` at the place after what it accepted (after the branch): the
  draft drafts on from it, sending a continuation it prepared there if it holds one.

Every outcome but FOLLOWUP advances the epoch (``epoch`` is the one the draft's next blocks carry).
No torch here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from svip_common.contracts import NO_TOKEN
from svip_common.errors import InvalidRequest

FOLLOWUP, PREPARED, DRAW, SETTLED = "followup", "prepared", "draw", "settled"
NEXTS = (FOLLOWUP, PREPARED, DRAW, SETTLED)


@dataclass(frozen=True)
class Outcome:
    epoch: int  # the epoch the draft's next blocks carry
    base: int  # the block's
    drafted: int  # its tokens (a tree: its spine)
    accepted: int
    token: int  # settled at the place after the accepted tokens (after the branch); NO_TOKEN: FOLLOWUP, DRAW
    next: str  # one of NEXTS
    branch: tuple[int, ...] = ()  # a tree: the tokens settled from base + accepted on, off the spine
    next_tokens: int | None = None  # FOLLOWUP, PREPARED: the block's tokens verified next (None: all the draft sent)

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Consistent (InvalidRequest names what is not): a peer's outcome is read through this."""
        if self.next not in NEXTS:
            raise InvalidRequest(f"unknown outcome {self.next!r}; one of {', '.join(NEXTS)}")
        if not 0 <= self.accepted <= self.drafted:
            raise InvalidRequest(f"feedback accepts {self.accepted} of {self.drafted} tokens")
        whole = self.accepted == self.drafted
        if self.next == FOLLOWUP and not (whole and self.token == NO_TOKEN and not self.branch):
            raise InvalidRequest("a follow-up's outcome accepts the whole block and settles no token")
        if self.next == DRAW and (whole or self.token != NO_TOKEN):
            raise InvalidRequest("a drawn correction follows a rejection, its token drawn by the draft")
        if self.next in (PREPARED, SETTLED) and self.token == NO_TOKEN:
            raise InvalidRequest(f"a {self.next} outcome settles a token")
        if self.next == PREPARED and whole:
            raise InvalidRequest("a prepared continuation follows a rejection")
        if self.next_tokens is not None and (self.next not in (FOLLOWUP, PREPARED) or self.next_tokens < 1):
            raise InvalidRequest("only a follow-up's or a prepared continuation's outcome says how many of its tokens "
                                 "go on, at least one")

    @property
    def prepared_key(self) -> tuple[int, int, int]:
        """The rejection a continuation was prepared for: (base, accepted, the token settled at the
        rejected place: the branch's sibling where a tree took one)."""
        return self.prepared_key_for(self.token)

    def prepared_key_for(self, correction: int) -> tuple[int, int, int]:
        """prepared_key, the token at the rejected place being ``correction`` where the draft drew it (DRAW)."""
        token = correction if self.next == DRAW else self.token
        return self.base, self.accepted, self.branch[0] if self.branch else token

    @property
    def below_sibling(self) -> tuple[int, ...] | None:
        """What a verdict that took a tree's sibling settled past it, the target deciding the place
        after (SETTLED): the nodes it took below the sibling, then its token. A continuation
        prepared after that sibling goes on past them where it drafted the same. None: no sibling
        taken, one whose continuation is verified next (PREPARED), or the token left to the draft."""
        if not self.branch or self.next != SETTLED:
            return None
        return tuple(self.branch[1:]) + (self.token,)

    @property
    def after_sibling(self) -> bool:
        """A continuation prepared after a tree's sibling is verified next: it begins with the
        nodes the branch took below that sibling, and its own verdict settles them."""
        return self.next == PREPARED and bool(self.branch)

    def known(self, tokens: Sequence[int], correction: int = NO_TOKEN) -> list[int]:
        """What the verdict leaves known from ``base`` on, for a block of these tokens: the accepted
        ones, the branch (only its sibling when a continuation prepared after it goes on), and the
        settled token (``correction``: the one the draft drew, for DRAW)."""
        taken = list(self.branch[:1] if self.after_sibling else self.branch)
        token = correction if self.next == DRAW else self.token
        return list(tokens[: self.accepted]) + taken + ([] if self.after_sibling else [token])


def outcome_of(epoch: int, base: int, drafted: int, accepted: int, token: int, branch: tuple[int, ...],
               deferred: bool, prepared_used: bool, next_tokens: int | None = None) -> Outcome:
    """The outcome of a decided verdict (the target's SessionPipeline decides deferred and
    prepared_used: _resolve_ahead); token: the place after as settled there (NO_TOKEN: the
    follow-up settles it when deferred, else the draft draws it); next_tokens: the follow-up's
    tokens verified next, where it grew."""
    if deferred:
        return Outcome(epoch, base, drafted, accepted, NO_TOKEN, FOLLOWUP, next_tokens=next_tokens)
    if prepared_used:
        return Outcome(epoch, base, drafted, accepted, token, PREPARED, tuple(branch), next_tokens)
    return Outcome(epoch, base, drafted, accepted, token, DRAW if token == NO_TOKEN else SETTLED, tuple(branch))
