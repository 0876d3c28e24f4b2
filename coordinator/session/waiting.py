"""What a distributed session asks of the target while it waits on its draft's block: a part of
SessionPipeline (pipeline.py) over the state state.py declares (mode, verifying, waiting_since,
committed, feedback, gate). The host's idle work (idle_work.py) asks each session whether it wants
its next row computed ahead (a prefill) and whether it may settle the target's own next token from
it (a fill), and does so."""

from __future__ import annotations

from coordinator.session.effects import event
from coordinator.session.state import DraftMode, SessionState
from svip_common.step_cost import StepCost, block_wait, early_row_gain


class WhileWaiting(SessionState):
    def wants_prefill(self) -> bool:
        """The session waits on its draft's block, and the target's cache lacks the row for the
        next place (the last verdict's token, or the prompt, not yet taken in), which it knows (not
        a sampled correction the draft draws): a forward while the target idles may take it in
        (IdleWork prices it: prefills_that_pay, by block_wait and prefill_gain)."""
        return self._lacks_its_next_row

    @property
    def prompt_owed(self) -> bool:
        """Its prompt is not taken in yet: a forward that does is owed anyway, and always worth it."""
        return self.target.cached_tokens == 0

    def block_wait(self, now: float) -> float | None:
        """The seconds until its draft's block is due (None: it waits on none)."""
        return block_wait(self.gate, now - self.waiting_since) if self._waits_on_draft else None

    def block_waited(self, now: float) -> float | None:
        """The seconds since its verdict, while it waits on the block its draft sends after one
        (None otherwise: no verdict yet, or no block awaited): what the host reads against the
        recent delays to price holding its step for the block (IdleWork.hold_s)."""
        return now - self.waiting_since if self._waits_on_draft and self._after_a_verdict else None

    def prefill_gain(self, verify: StepCost) -> float:
        """What its next row taken in ahead saves it, in the target's seconds (early_row_gain)."""
        return early_row_gain(self.gate, verify)

    def wants_fill(self) -> bool:
        """The target never idles for a block: a greedy session that waits on its draft settles
        the target's own next token, from the row stored for exactly its committed tokens (a
        prefill's, or the last verification's: ``TargetSession.next_token``), and the block that
        comes later is checked against the tokens settled so meanwhile (``_verify``). Exact by
        construction: every token is the target's own choice. Not for sampled sessions: whether
        a place is drawn by the target alone or by a verdict would depend on timing, and a seeded
        request must reproduce."""
        return self.request.sampling.greedy and self._waits_on_draft

    def wants_ride(self) -> bool:
        """A greedy session waiting on its draft, its prompt taken in, whose cache lacks the row for
        its next place: a row of it in the step that verifies other sessions' blocks settles the
        target's own next token (wants_fill; the host prices it: IdleWork.riders)."""
        return self.request.sampling.greedy and not self.prompt_owed and self._lacks_its_next_row

    @property
    def ride_value(self) -> float:
        """What such a row gains, in tokens: the block to come parts from the target's own token
        there with the chance its drafted tokens are rejected (1 - the session's acceptance), and
        the ride finds that out a forward sooner, with no forward of its own; where the block
        agrees, it ends where it would have (its first token is the one settled here)."""
        return 1.0 - self.gate.acceptance.value

    @property
    def uncached_tokens(self) -> int:
        """The committed tokens the target's cache lacks (a row taking them in holds that many)."""
        return len(self.committed) - self.target.cached_tokens

    @property
    def _lacks_its_next_row(self) -> bool:
        """It waits on its draft's block, and the target's cache lacks the row for its next place,
        which it knows (not a sampled correction the draft draws)."""
        return self._waits_on_draft and not self.feedback.correction_due and self.target.lacks_next_row(self.committed)

    @property
    def _waits_on_draft(self) -> bool:
        """The session waits for its draft's next block, with nothing being verified."""
        return (
            not self.done and self.mode is DraftMode.DRAFTING and self.verifying is None
            and self.waiting_since is not None
        )

    @event
    def fill(self, started: float, ended: float) -> None:
        """Settle the target's own token for the next place if its row is stored (wants_fill
        said the session may); started, ended: the forward that stored it (a prefill while idle;
        equal: none ran for it). A token settled is a Settle among its effects."""
        token = self.target.next_token(self.committed)
        if token is None:
            return
        now = self.now
        self.filled += 1
        self.log.round(self._empty_block(), 0, (now, started, ended, "filled"), now)
        self._commit(*self._clipped([token]))
