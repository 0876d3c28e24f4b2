"""How much a distributed session's draft may draft, and what each verdict teaches it: a part of
SessionPipeline (pipeline.py) over the state state.py declares (gate, pausing, auto, the load).
Load-aware speculation caps the next blocks at what pays at the target's measured load and pauses
the draft when nothing does (svip_common/step_cost.py); policy auto's stop rule is refit from
every verdict (svip_common/acceptance.py); a block that answers a feedback times the round trip
that the gate charges a drafting round."""

from __future__ import annotations

from coordinator.session.effects import DraftAnswered
from coordinator.session.state import DraftMode, SessionState
from svip_common.acceptance import StopRule
from svip_common.messages import DraftedBlock
from svip_common.trees import node_price


class SpeculationBudget(SessionState):
    def _record(self, block: DraftedBlock, accepted: int, overlapped: bool = False) -> None:
        """The verdict on a drafted block, into load-aware speculation's estimate and auto's.
        overlapped: drafted while the target verified the block before it (verified with no round
        trip), so its drafting delayed nothing."""
        if block.tokens:
            self.gate.record(len(block.tokens), accepted, block.draft_s)
            if self.auto is not None:
                self._learn(block, accepted, overlapped)

    def _cap(self) -> int | None:
        """Load-aware speculation: the most tokens the next block should hold (None: no cap)."""
        return self.pausing.cap() if self.with_draft else None

    def _learn(self, block: DraftedBlock, accepted: int, overlapped: bool) -> None:
        """auto: the verdict on a drafted block, into the pair's estimate and the session's rate.
        An overlapped block's acceptance counts as any other's, but its drafting and round trip
        cost nothing (SessionStop.record). A block the target waited for is priced by what it
        delayed. In sync a draft step carries only such blocks, so a block's share of the steps
        (draft_s) is that. In async the steps also carry follow-ups and prepared continuations,
        yet each of the waited-for block's tokens held its session for a whole step while the
        target served the batch's other sessions: its drafting counts as the steps it rode over
        the sessions a target step serves. Priced at its share, a token cost a sliver of a step
        and async auto made 0.79x SVIP's tokens at 8 sessions on code (docs/benchmarks.md,
        seventeenth round)."""
        entropies, probs = block.block.entropies, block.block.probs
        if overlapped:
            self.auto.record(entropies, probs, accepted, overlapped=True)
            return
        load = self._load()
        if load is not None and self.pipeline == "async":
            held_s, round_s = block.elapsed_s / max(load.batch, 1.0), self.auto.round_trip.value
        else:
            held_s, round_s = block.draft_s, self.gate.round_s
        round_tokens = load.round_tokens(round_s) if load is not None else 0.0
        self.auto.record(entropies, probs, accepted, held_s, round_tokens)

    def _node_price(self) -> float | None:
        """A verified node's price in tokens at the target's load now (None: a sync chain's, which
        nothing prices). Trees auto and deep-auto price their siblings by it; any tree, the places
        a continuation taken up past a sibling keeps (draft_worker/drafter.py, ``go_on_past``); an
        async session, each token a block drafts past its stop (draft_worker/stepping.py, ``_extends``)."""
        if self.request.policy.tree == "off" and self.pipeline != "async":
            return None
        load = self._load()
        return 0.0 if load is None else node_price(load.plain_rate, load.verify_token_s)

    def _stop_rule(self) -> StopRule | None:
        """auto: the rule for the next blocks, at this session's tau now (None: not policy auto)."""
        return self.auto.rule(self._load()) if self.auto is not None else None

    def _pause(self) -> None:
        """The draft drafts nothing (its feedback said load_cap 0); the target goes on alone."""
        self.mode = DraftMode.PAUSED
        self.pausing.pause()
        self.pausing.settle(self.committed[self.draft_base:])  # the draft learns its own tokens on resume

    def _resume(self, cap: int) -> None:
        """Drafting pays again: the draft gets the tokens settled since the pause and its cap."""
        self.mode = DraftMode.DRAFTING
        resume = self.pausing.resume(self.sid, self.epoch, len(self.committed), cap, self._stop_rule())
        self.draft_base = len(self.committed)
        self._feedback_sent_at = self.now
        self._to_draft(resume)

    def _note_feedback_answered(self, block: DraftedBlock, received_at: float) -> None:
        """A block drafted in answer to the latest feedback: that round's return trip (for the
        stats, and what load-aware speculation charges a drafting round beyond its forwards)."""
        if block.trigger_at and self._feedback_sent_at:
            self.gate.record_round_trip(max(0.0, received_at - self._feedback_sent_at - block.draft_s))
            if self.auto is not None:  # beyond the steps it rode, which auto counts as its drafting (_learn)
                self.auto.round_trip.update(max(0.0, received_at - self._feedback_sent_at - block.elapsed_s))
            self._emit(DraftAnswered(received_at - self._feedback_sent_at))
            self.log.feedback_answered(block, self._feedback_sent_at)
            self._feedback_sent_at = 0.0
