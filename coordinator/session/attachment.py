"""Whether a draft works on a distributed session, and what happens when that changes: a part of
SessionPipeline (pipeline.py) over the state state.py declares (mode, epoch, committed, verifying,
reattach, ahead, feedback). The draft's session starts on the committed tokens; a draft
lost or stalled is left behind (*detach*: the epoch advances, the target settles tokens alone; a
sampled session first holds for it so that a seed reproduces); one back takes the session up again
(*attach*), not before a stall's backoff; one that failed the session is given up for good. Why
each step is exact: pipeline.py's docstring, Recovery."""

from __future__ import annotations

import logging

from coordinator.session.effects import event
from coordinator.session.reattach import AttachWait
from coordinator.session.state import DraftMode, SessionState
from svip_common.contracts import Verdict
from svip_common.messages import Cancel, DraftedBlock, SessionStart

log = logging.getLogger("coordinator.session.pipeline")


class DraftAttachment(SessionState):
    """A part of SessionPipeline (this module's docstring)."""

    @event
    def start(self, draft_available: bool) -> None:
        """The session begins; draft_available: a draft worker is connected now."""
        if not self.with_draft:
            self._verify(self._empty_block(), self.now, "none")
        elif not draft_available:
            self._detach(cancel=False)
        else:
            self._start_draft()

    @event
    def cancel(self) -> None:
        """The caller ended the session (it went away, or a stop string): report, and free both sides."""
        if not self.done:
            self._finish("cancelled")

    @event
    def close(self) -> None:
        """The session is dropped (finished, cancelled, or its caller's stream is gone): its
        pages go back to the pool and the draft's session is cancelled."""
        self._close()

    @event
    def detach(self, cancel: bool) -> None:
        self._detach(cancel)

    @event
    def attach(self) -> None:
        self._attach(self.now)

    @event
    def retry_attach(self) -> None:
        """A re-attach that waited for its backoff, now due (the host checks periodically)."""
        if self.reattach.backoff_over(self.now):
            self._attach(self.now)

    @event
    def hold_expired(self) -> None:
        self._hold_expired(self.now)

    @event
    def on_bad_draft_message(self, why: str) -> None:
        """The draft sent what cannot be read (the service's edge found it malformed): the draft's
        fault, never the caller's. A detached session ignores it, as every message of the old draft."""
        if not self.done and not self.detached:
            self._give_up_draft(why, cancel=True)

    def _close(self) -> None:
        self.target.close()
        if self._draft_holds_session:
            self._to_draft(Cancel(self.sid))
        self.mode = DraftMode.CLOSED

    @property
    def paused(self) -> bool:
        return self.mode is DraftMode.PAUSED

    @property
    def detached(self) -> bool:
        """No draft works on the session (for now, or for good)."""
        return self.mode in (DraftMode.DETACHED, DraftMode.GIVEN_UP)

    @property
    def _draft_holds_session(self) -> bool:
        """The draft worker holds a session of ours (drafting or paused): a Cancel is owed when it ends."""
        return self.with_draft and self.mode in (DraftMode.DRAFTING, DraftMode.PAUSED)

    @property
    def draft_given_up(self) -> bool:
        return self.mode is DraftMode.GIVEN_UP

    def _start_draft(self) -> None:
        """The draft's session, on the committed tokens (the prompt, or more on a re-attach), at
        the current epoch, with what is left of the budget."""
        r, cap = self.request, self._cap()
        start = SessionStart(
            session_id=self.sid,
            prompt_ids=tuple(self.committed),
            max_new_tokens=r.max_new_tokens - len(self.generated),
            sampling=r.sampling,
            policy=r.policy,
            stop_token_ids=self.stop_ids,
            pipeline=self.pipeline,
            epoch=self.epoch,
            load_cap=cap,
            stop_rule=self._stop_rule(),
            node_price=self._node_price(),
            cache_scope=r.cache_scope,
        )
        self.draft_base = len(self.committed)
        self._to_draft(start)
        if cap == 0:
            self._pause()
            self._verify(self._empty_block(), self.now, "paused")
        else:
            self.waiting_since = self.now

    def _detach(self, cancel: bool) -> None:
        """Go on without the draft from the committed tokens (a sampled session first holds for
        it, hold_s). cancel: the draft worker is still connected (a stall): its session there is
        cancelled, and its answer (Closed) says it is back."""
        if self.done or not self.with_draft or self.detached:
            return
        # a stall (cancel): an overloaded draft is not handed this session's re-prefill at once again
        self.reattach.detached(self.now, stalled=cancel, sampled=not self.request.sampling.greedy)
        if cancel and self._draft_holds_session:  # a stall: the draft still holds the session
            self._to_draft(Cancel(self.sid))
        self.mode, self.waiting_since = DraftMode.DETACHED, None
        self.stats.detached += 1
        self.epoch += 1  # what the old draft sent or sends is stale
        self.ahead.drop_all()
        self.feedback.reset()
        self.pausing.forget()
        if self.verifying is None:
            self._go_alone()

    def _attach(self, now: float) -> None:
        """A draft is back: it takes the session up from the committed tokens (not before the
        backoff after a stall ends; never after the draft failed the session, or stalled under it
        MAX_STALLS times)."""
        if self.done or self.mode is not DraftMode.DETACHED or self.reattach.retired:
            return
        if now < self.reattach.not_before:
            self.reattach.waiting = AttachWait.BACKOFF  # retry_attach takes it up once the backoff is over
            return
        if self.verifying is not None:
            self.reattach.waiting = AttachWait.VERDICT  # taken up once the verdict in flight is decided
            return
        self.reattach.attached()
        self.mode = DraftMode.DRAFTING
        self.stats.reattached += 1
        self._start_draft()

    def _hold_expired(self, now: float) -> None:
        """A sampled session waited for a draft long enough: the target goes on alone."""
        if self.detached and self.reattach.hold_over(now) and self.verifying is None:
            self._go_alone()

    def stalled(self, now: float, deadline_s: float) -> bool:
        """The session has waited on the draft longer than deadline_s."""
        return (
            not self.done
            and self.waiting_since is not None
            and not self.detached
            and not self.paused
            and self.verifying is None
            and now - self.waiting_since > deadline_s
        )

    def _go_alone(self) -> None:
        if self.reattach.hold_until is None:
            self._verify(self._empty_block(), self.now, "detached")

    def _decide_detached(self, block: DraftedBlock, verdict: Verdict, timing: tuple[float, float, float, str]) -> None:
        """A verdict while no draft works on the session: the target's own token, or a verdict on
        a block drafted before the draft was lost (greedy: kept; sampled: voided, see above)."""
        decided = self.now
        self.verifying = None
        stale = block.epoch != self.epoch
        if stale and not self.request.sampling.greedy:
            self.stats.discarded_tokens += len(block.tokens)
            settled = []
        else:
            settled = self._new_tokens(block, verdict.accepted, verdict.token, verdict.branch)
            self.log.round(block, verdict.accepted, timing, decided)
        self._commit(*self._clipped(settled))
        if self.done:
            return
        if self.reattach.waiting is AttachWait.VERDICT:
            self._attach(self.now)
        else:
            self._go_alone()

    def _give_up_draft(self, why: str, cancel: bool) -> None:
        """The draft failed this session: the target goes on alone, at once (no hold: the draft
        will not take the session up again)."""
        log.warning("session %s: %s; going on without the draft", self.sid, why)
        self._detach(cancel)
        if self.detached:
            self.mode = DraftMode.GIVEN_UP
        self._hold_expired(float("inf"))
