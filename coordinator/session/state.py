"""The state a distributed session's parts share, declared in one place. SessionPipeline
(pipeline.py) is this state and its parts: the round (pipeline.py), whether a draft works on the
session (attachment.py), what the target does while it waits (waiting.py), how much the draft may
draft (speculation.py). Each part subclasses SessionState, so every field it reads and every step
of another part it calls is named here, with the module that defines it."""

from __future__ import annotations

import enum
from collections.abc import Callable

from coordinator.session.ahead import AheadBlocks
from coordinator.session.effects import Effects
from coordinator.session.feedback import FeedbackChain
from coordinator.session.pausing import LoadCap, LoadPause
from coordinator.session.reattach import Reattach
from coordinator.session.round_log import RoundLog
from svip_common.acceptance import SessionStop, StopRule
from svip_common.contracts import GenerationRequest, Limits, Verdict
from svip_common.messages import DraftedBlock, DraftRequest
from svip_common.step_cost import SessionGate, TargetLoad
from target_worker.verifier import TargetSession


class DraftMode(enum.Enum):
    """Who proposes the session's blocks: one state, not a flag per situation."""

    DRAFTING = "drafting"  # the draft worker proposes blocks
    PAUSED = "paused"  # load-aware: the draft waits for a Resume; the target settles tokens alone
    DETACHED = "detached"  # recovery: no draft works on the session; the target settles tokens alone until one is back
    GIVEN_UP = "given up"  # the draft failed the session (an error, a bad block): the target goes on alone for good
    CLOSED = "closed"  # the session is over: its draft session is cancelled, nothing more goes to the draft


class SessionState(Effects):
    """One session's state on the target side (its parts: this module's docstring)."""

    def __init__(
        self,
        session_id: str,
        request: GenerationRequest,
        stop_ids: frozenset[int],
        limits: Limits,
        target: TargetSession,
        with_draft: bool,
        pipeline: str,
        now: float,
        load_cap: LoadCap | None = None,
        hold_s: float = 0.0,
        auto: SessionStop | None = None,
        load: Callable[[], TargetLoad | None] = lambda: None,
    ):
        """with_draft: a draft worker drafts for the session (False: the target alone); now: the
        time it starts; load_cap: load-aware speculation (None: the policy drafts as configured at
        any load); hold_s: how long a sampled session waits for a lost draft before the target goes
        on alone; auto: the session's learnt stop (policy auto; svip_common/acceptance.py), its
        rule sent with each start, feedback and resume; load: the target's load now (what a
        drafted token costs, for auto's tau)."""
        # what the session is
        self.sid: str = session_id
        self.request: GenerationRequest = request
        self.stop_ids: frozenset[int] = stop_ids
        self.limits: Limits = limits
        self.target: TargetSession = target
        self.with_draft: bool = with_draft
        self.pipeline: str = pipeline  # "sync" or "async"
        # what is settled, and the draft's line
        self.committed: list[int] = list(request.prompt_ids)
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.epoch: int = 0  # the draft's line: a block of an older epoch is stale
        self.verifying: DraftedBlock | None = None  # verified, its decision not yet taken
        # where the draft's next main-line block starts; committed tokens past it are the target's
        # own, settled while it waited for that block (fill), which the block is checked against
        self.draft_base: int = len(self.committed)
        self.filled: int = 0  # tokens the target settled alone while the session waited (a round each)
        # the draft's side
        self.mode: DraftMode = DraftMode.DRAFTING
        self.waiting_since: float | None = None  # since when the session waits on the draft (stall check)
        self.log: RoundLog = RoundLog(started=now)
        self.stats = self.log.stats
        self.ahead: AheadBlocks = AheadBlocks(self.stats)  # async: blocks drafted ahead of the verdict in flight
        self.reattach: Reattach = Reattach(hold_s)  # recovery: when a detached session may take a draft up again
        self.feedback: FeedbackChain = FeedbackChain(session_id)  # verdicts' feedback not yet sent, a correction owed
        # how much the draft may draft
        self.gate: SessionGate = SessionGate(cuts=auto is None)  # load-aware speculation's estimate
        self.pausing: LoadPause = LoadPause(load_cap, self.gate, self.stats)  # its cap, and tokens settled paused
        self.auto: SessionStop | None = auto if with_draft else None
        self._load: Callable[[], TargetLoad | None] = load
        self._feedback_sent_at: float = 0.0  # of the latest feedback; its round is the last one recorded

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def _after_a_verdict(self) -> bool:
        """It has had a round decided by a verdict (not only tokens the target settled alone)."""
        return self.stats.rounds > self.filled

    # --- the steps one part calls in another (defined where each says) ------------------------------

    def _verify(self, block: DraftedBlock, received_at: float, source: str) -> None:  # pipeline.py
        raise NotImplementedError

    def _commit(self, tokens: list[int], reason: str | None = None) -> None:  # pipeline.py
        raise NotImplementedError

    def _clipped(self, tokens: list[int]) -> tuple[list[int], str | None]:  # pipeline.py
        raise NotImplementedError

    def _new_tokens(self, block: DraftedBlock, accepted: int, token: int,
                    branch: tuple[int, ...] = ()) -> list[int]:  # pipeline.py
        raise NotImplementedError

    def _empty_block(self) -> DraftedBlock:  # pipeline.py
        raise NotImplementedError

    def _finish(self, reason: str) -> None:  # pipeline.py
        raise NotImplementedError

    def _to_draft(self, request: DraftRequest) -> None:  # pipeline.py
        raise NotImplementedError

    def _decide_detached(self, block: DraftedBlock, verdict: Verdict,
                         timing: tuple[float, float, float, str]) -> None:  # attachment.py
        raise NotImplementedError

    def _detach(self, cancel: bool) -> None:  # attachment.py
        raise NotImplementedError

    def _close(self) -> None:  # attachment.py
        raise NotImplementedError

    def _attach(self, now: float) -> None:  # attachment.py
        raise NotImplementedError

    def _hold_expired(self, now: float) -> None:  # attachment.py
        raise NotImplementedError

    def _give_up_draft(self, why: str, cancel: bool) -> None:  # attachment.py
        raise NotImplementedError

    @property
    def paused(self) -> bool:  # attachment.py
        raise NotImplementedError

    @property
    def detached(self) -> bool:  # attachment.py
        raise NotImplementedError

    def _cap(self) -> int | None:  # speculation.py
        raise NotImplementedError

    def _stop_rule(self) -> StopRule | None:  # speculation.py
        raise NotImplementedError

    def _node_price(self) -> float | None:  # speculation.py
        raise NotImplementedError

    def _pause(self) -> None:  # speculation.py
        raise NotImplementedError

    def _resume(self, cap: int) -> None:  # speculation.py
        raise NotImplementedError

    def _record(self, block: DraftedBlock, accepted: int, overlapped: bool = False) -> None:  # speculation.py
        raise NotImplementedError

    def _note_feedback_answered(self, block: DraftedBlock, received_at: float) -> None:  # speculation.py
        raise NotImplementedError
