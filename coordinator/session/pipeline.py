"""One session of the distributed pipeline, hosted beside the verifier.

The target worker's process runs this logic on its compute thread (coordinator/session/host.py), so a
round crosses one hop each way: the draft worker's block arrives and is verified at once, and the
feedback goes straight back; the caller receives the settled tokens as a side stream.

    draft ──block(epoch, base)──►  session + verifier  ──settled tokens──►  caller
    draft ◄────────feedback──────  session + verifier

Async mode: while a block is verified the draft writes its follow-up (the next block, should this
one be accepted whole) and prepared continuations (the next block after a likely rejection, for
each of the draft's likely corrections there); they wait here. On a full acceptance the follow-up
is verified next with no round trip, its first token checked against the target's stored row for
that place; on a rejection whose correction a prepared continuation assumed, that one is verified
next, also with no round trip. Otherwise the epoch advances, every block of the old epoch is
discarded by its tag, never verified, and the draft rolls back. Sync mode drafts nothing ahead.
Each round is verify (one target forward) then decide, two steps of the compute thread, so blocks
that arrive during the forward are seen before the decision.

Load-aware speculation (svip_common/step_cost.py): each feedback caps the draft's next blocks at
what pays at the target's measured load. When that is nothing, the session pauses: the feedback
says so, the target settles the next tokens alone (one token per batched step, as without a
draft), and when drafting pays again one Resume gives the draft those tokens and its next cap.

Recovery (docs/architecture.md, Placement): a draft worker that is lost, or that leaves the session waiting
past its stall deadline, no longer ends it. The session *detaches*: the epoch advances (whatever
the old draft sent or sends is stale), the verdict in flight is kept if greedy and voided if
sampled (a rejection's correction needs the draft's q row; voiding regardless of the outcome
keeps the distribution exact), and the target settles the next tokens alone. A sampled session
first holds for a replacement (until its hold deadline), so a seeded request still reproduces:
its next block is the one an undisturbed draft would have drafted, since every draw is keyed by
position. When a draft is back the session *re-attaches*: a StartSession of its committed tokens
at the current epoch, and drafting goes on from there.
"""

from __future__ import annotations

import dataclasses
import functools

from coordinator.session.ahead import Waiting
from coordinator.session.attachment import DraftAttachment
from coordinator.session.effects import Finish, Settle, ToDraft, Verify, event
from coordinator.session.speculation import SpeculationBudget
from coordinator.session.state import DraftMode
from coordinator.session.waiting import WhileWaiting
from coordinator.session.wire_checks import (
    check_block,
    check_correction,
    check_growth,
    check_held,
    check_prepared,
    check_timings,
)
from svip_common.contracts import (
    NO_TOKEN,
    Block,
    Verdict,
    clip_settled,
)
from svip_common.errors import WorkerError
from svip_common.messages import (
    DraftClosed,
    DraftedBlock,
    DraftEvent,
    DraftFailed,
    DraftRequest,
)
from svip_common.sequences import common_prefix

# blocks verified with no round trip: drafted while the target verified the block before them
OVERLAPPED = ("followup", "prepared")


class SessionPipeline(DraftAttachment, WhileWaiting, SpeculationBudget):
    """One session's protocol on the target side, with no I/O: each event (a method marked
    @event) takes the time now and returns its effects (effects.py), which the host carries out.
    The round is here: a block in (on_draft_event), verified (_verify asks for it: Verify; the
    host's batched step answers verified), decided (_decide: the feedback, the blocks drafted
    ahead, the settled tokens) and the next one started (_next_round). Its state is declared in
    state.py (SessionState: its fields and __init__); its parts, each in its own module over that
    state: whether a draft works on the session (attachment.py), what the target does while it
    waits (waiting.py), how much the draft may draft (speculation.py)."""

    @property
    def cached_tokens(self) -> int:
        return self.target.cached_tokens

    # --- from the draft worker ---------------------------------------------------------------------

    @event
    def on_draft_event(self, message: DraftEvent, received_at: float, size: int, draft_available: bool) -> None:
        """The draft's message (size: its bytes on the wire); draft_available: a draft worker is
        connected now."""
        self.log.wire_bytes += size
        if isinstance(message, DraftClosed) and message.shed:  # the draft gave the session up (its KV pool is full)
            self._detach(cancel=False)  # if not detached already
            self._hold_expired(float("inf"))  # it will not take this session up again: no hold
            return
        if self.detached:  # stale: the old draft session's; a Closed says a stalled draft is back
            if isinstance(message, DraftClosed) and draft_available:
                self._attach(self.now)
            return
        if isinstance(message, DraftFailed):  # the draft failed this session (a bug, or a limit): never the caller's
            self._give_up_draft(f"the draft worker reported code {message.code}: {message.message[:200]}", cancel=False)
            return
        if isinstance(message, DraftedBlock) and not self.done:
            try:
                self._on_block(message, received_at)
            except WorkerError as exc:  # a bad block is the draft's fault: checked before it changes anything
                self._give_up_draft(str(exc), cancel=True)

    def _on_block(self, block: DraftedBlock, received_at: float) -> None:
        check_timings(block)
        self.log.busy("draft", block.started_at, block.finished_at)
        self._note_feedback_answered(block, received_at)
        if block.epoch != self.epoch:
            self.stats.discarded_tokens += len(block.tokens)  # drafted on a rolled-back base
            return
        if self.paused:
            raise WorkerError("draft worker sent a block while the session is paused")
        if block.grows:  # more of the follow-up held here; too late for one verified already: dropped
            check_growth(block, self.request, self.limits)
            if not self.ahead.grow(block):
                self.stats.discarded_tokens += len(block.tokens)
            return
        if block.prepared_for is not None:
            parent = block.prepared_for[0]
            undecided = self.verifying.base if self.verifying is not None else self.draft_base
            check_prepared(parent, len(self.committed), len(self.ahead.prepared), self.limits)
            if parent >= undecided:  # its parent's verdict is still to come
                self.ahead.keep_prepared(block.prepared_for, block, received_at)
            else:  # its parent's verdict is already out: the draft sends it again if it applies
                self.stats.discarded_tokens += len(block.tokens)
            return
        if block.reused:
            self.stats.prepared_used_late += 1
        if block.resolved_token != NO_TOKEN:
            self._commit(*self._clipped([self._checked_correction(block.resolved_token)]))
            if self.done:
                return
        if self.verifying is None:
            self._verify(block, received_at, "drafted" if self._after_a_verdict else "first")
        else:
            check_held(block, self.request, self.limits)  # as it comes: its block's forward may feed it (Lookahead)
            self.ahead.hold_followup(block, received_at)  # verified next if the block before it is accepted whole

    # --- a round: verify, then decide ---------------------------------------------------------------

    def _verify(self, block: DraftedBlock, received_at: float, source: str) -> None:
        """source: how the block came to be verified (stats): see GenerationStats.round_sources.
        A follow-up whose first token the target's stored row already rejects is decided at once,
        no forward, and its feedback joins the one before it; otherwise the feedback goes out
        before the forward."""
        checked = self._checked(block)
        waited = received_at - self.waiting_since if self.waiting_since is not None and source == "drafted" else None
        self.verifying, self.waiting_since = block, None
        own = self.committed[block.base:]  # the target's own tokens, settled while it waited (fill)
        if own:
            agreed = common_prefix(block.tokens, own)
            if agreed < len(own):  # the block parts from them: decided by them, no forward
                self.target.judged_alone(len(block.tokens))
                now = self.now
                self._decide(block, Verdict(block.base, agreed, own[agreed], epoch=block.epoch),
                             (received_at, now, now, source))
                return
            self.target.judged_alone(agreed)
            checked = _after(checked, agreed)  # the rest of the block is verified after them
        early = self.target.judge_first(self.committed, checked)
        if early is not None:
            self._decide(block, early, (received_at, self.now, self.now, source))
            return
        self._flush_feedback()
        self._emit(Verify(block, checked, received_at, source, waited))

    @event
    def verified(
        self, block: DraftedBlock, verdict: Verdict, received_at: float, source: str, started: float, ended: float
    ) -> None:
        """The verdict from the host's batched step (one target forward for every session ready),
        with the block as Verify named it. The host delivers it after what arrived during the
        forward (prepared blocks, follow-ups), so that is taken in first."""
        self.log.busy("target", started, ended)
        self._decide(block, verdict, (received_at, started, ended, source))

    def _decide(self, block: DraftedBlock, verdict: Verdict, timing: tuple[float, float, float, str]) -> None:
        """The verdict's consequences, the critical ones first: the feedback to the draft, then
        the next block if it is already here; the caller's tokens and the stats after."""
        if self.done:
            return
        verdict = _on_whole_block(block, verdict)
        if self.detached:
            self._decide_detached(block, verdict, timing)
            return
        decided = self.now
        self.verifying = None
        self._record(block, verdict.accepted, overlapped=timing[3] in OVERLAPPED)
        cap, was_paused = self._cap(), self.paused
        token, ready, deferred, pause = self._resolve_ahead(block, verdict, cap, was_paused)
        # a tree's sibling (and nodes below it) settled from the rejected place on; one prepared
        # after the sibling starts right after it
        past = 0 if ready is not None else len(verdict.branch)
        self.draft_base = block.base + verdict.accepted + past + (0 if deferred else 1)  # the draft's next block's
        settled, reason = self._clipped(self._new_tokens(block, verdict.accepted, token, verdict.branch))
        if reason is None and self.with_draft and not was_paused:
            # a cap of 0 that cannot pause yet: the draft still writes the next block, of one token
            next_cap = cap if pause or cap is None else max(cap, 1)
            self._send_feedback(block, verdict, token, ready, deferred, next_cap)
        self.log.round(block, verdict.accepted, timing, decided)
        if block.block.siblings is not None:
            self.stats.record_tree(block.block.nodes, len(verdict.branch))
        self._commit(settled, reason)
        if pause:
            self._pause()
        if not self.done:
            self._next_round(was_paused, cap, settled, ready, deferred, verdict)
        self._flush_feedback()
        waiting = not self.done and self.verifying is None and not self.paused and self.with_draft
        self.waiting_since = decided if waiting else None

    def _new_tokens(self, block: DraftedBlock, accepted: int, token: int, branch: tuple[int, ...] = ()) -> list[int]:
        """What a verdict settles that is not committed yet: the accepted tokens, a tree's nodes
        taken from the rejected place on (branch) and the next place's token (NO_TOKEN: none here),
        less those the target settled alone while it waited."""
        path = list(block.tokens[:accepted]) + list(branch)
        decided = path + ([token] if token != NO_TOKEN else [])
        return decided[len(self.committed) - block.base:]

    def _clipped(self, tokens: list[int]) -> tuple[list[int], str | None]:
        return clip_settled(tokens, self.request.max_new_tokens - len(self.generated), self.stop_ids)

    def _resolve_ahead(
        self, block: DraftedBlock, verdict: Verdict, cap: int | None, was_paused: bool
    ) -> tuple[int, Waiting | None, bool, bool]:
        """What the verdict makes of the epoch and of the blocks drafted ahead. Returns the token
        settled at the place after the accepted ones (NO_TOKEN: the follow-up settles it when
        deferred, else the draft draws it), the prepared continuation verified next (ready),
        deferred, and whether the session pauses."""
        k, accepted = len(block.tokens), verdict.accepted
        token, ready, deferred = verdict.token, None, False
        if accepted < k:
            self._new_epoch()
            if verdict.token != NO_TOKEN:  # prepared for the token (or the sibling) settled there
                ready = self.ahead.take_prepared(block.base, accepted, verdict.token, verdict.branch)
        elif block.followup:
            deferred, token = True, NO_TOKEN  # the follow-up's first token settles the next place
        # drafting no longer pays: pause at a verdict whose token is settled here (not a sampled
        # correction the draft draws, not a prepared block about to be verified)
        pause = cap == 0 and not was_paused and verdict.token != NO_TOKEN and ready is None
        if pause and accepted == k:  # the follow-up drafted on this block is voided
            self._new_epoch()
            deferred, token = False, verdict.token
        self.ahead.drop_prepared(None if accepted < k or pause else block.base)  # a rejection voids every one
        return token, ready, deferred, pause

    def _new_epoch(self) -> None:
        """The draft's line is rolled back: what it drafted on the old one is stale."""
        self.epoch += 1
        self.ahead.drop_followup()

    def _next_round(
        self, was_paused: bool, cap: int | None, settled: list[int], ready: Waiting | None, deferred: bool,
        verdict: Verdict,
    ) -> None:
        """After a decided verdict: what is verified next, if it is already known (the target's
        own step while paused or without a draft, a prepared continuation, the follow-up); else
        the session waits for the draft's block. ready: the prepared continuation the verdict
        chose; deferred: the follow-up settles the next place."""
        if was_paused:
            self.pausing.settle(settled, verdict.features, verdict.features_from)
        if was_paused and cap > 0:
            self._resume(cap)  # the draft's block comes next
        elif self.paused:
            self._verify(self._empty_block(), self.now, "paused")
        elif not self.with_draft:
            self._verify(self._empty_block(), self.now, "none")
        elif ready is not None:  # no round trip this time
            prepared_block, prepared_received = ready
            prepared_block.block.epoch = self.epoch
            self.stats.prepared_used += 1
            self.gate.record_round_trip(0.0)
            self._verify(prepared_block, prepared_received, "prepared")
        elif deferred and self.ahead.followup is not None:
            held, held_received = self.ahead.take_followup()
            self.gate.record_round_trip(0.0)
            self._verify(held, held_received, "followup")

    def _send_feedback(
        self, block: DraftedBlock, verdict: Verdict, token: int, ready: Waiting | None, deferred: bool,
        cap: int | None
    ) -> None:
        """Queue the feedback on a verdict; it leaves before the next forward (_flush_feedback).
        ready: the prepared continuation verified next."""
        held = self.ahead.followup if deferred else ready  # verified next as it is held now (it grew: growth.py)
        self.feedback.add(self.epoch, block, verdict, token, ready is not None, deferred, cap, self._stop_rule(),
                          self._node_price(), None if held is None else len(held[0].tokens))

    def _flush_feedback(self) -> None:
        """Send the queued feedback, several verdicts as one message (each the next one's ``then``)."""
        if self.done:
            self.feedback.drop()
            return
        head = self.feedback.take()
        if head is None:
            return
        self._feedback_sent_at = head.sent_at = self.now
        self._to_draft(head)

    def _checked(self, block: DraftedBlock) -> Block:
        """The block, checked; it starts where the draft's line does (the target's own tokens may follow)."""
        drafting = self.mode is DraftMode.DRAFTING and self.with_draft
        return check_block(block, self.draft_base if drafting else len(self.committed), self.request, self.limits)

    def _checked_correction(self, token: int) -> int:
        return check_correction(token, self.feedback.take_correction_due(), self.limits)

    def _empty_block(self) -> DraftedBlock:
        return DraftedBlock.empty(len(self.committed), self.epoch)

    def _commit(self, tokens: list[int], reason: str | None = None) -> None:
        """Settle tokens already clipped (reason: the finish they reach, if any)."""
        self.committed += tokens
        self.generated += tokens
        if tokens:
            self._emit(Settle(tuple(tokens), tuple(self.target.settled_logprobs(self.committed, len(tokens)))))
        if reason is not None:
            self._finish(reason)

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.ahead.drop_all()
        self._emit(Finish(reason, functools.partial(self.log.final, self.with_draft, self.now)))
        self._close()

    def _to_draft(self, request: DraftRequest) -> None:
        self._emit(ToDraft(request))


def _after(block: Block, n: int) -> Block:
    """The block's tokens after its first n (which the target settled alone), at their place."""
    if n == 0:
        return block
    rows = block.q_rows[n:] if block.q_rows is not None else None
    siblings = block.siblings[n:] if block.siblings is not None else None  # a tree's places after them keep theirs
    return Block(base=block.base + n, tokens=block.tokens[n:], probs=block.probs[n:], entropies=block.entropies[n:],
                 q_rows=rows, epoch=block.epoch, siblings=siblings)


def _on_whole_block(block: DraftedBlock, verdict: Verdict) -> Verdict:
    """A verdict on what followed the target's own tokens (verified after them), as the verdict on
    the whole block: those tokens count as accepted (the draft proposed them, and the feedback
    speaks of the block it sent)."""
    if verdict.base == block.base:
        return verdict
    return dataclasses.replace(verdict, base=block.base, accepted=verdict.accepted + verdict.base - block.base)
