"""What a session tells its draft after each verdict, on the target side. A verdict's feedback is
queued when the verdict is decided and leaves before the next forward: verdicts decided in one
step (a follow-up the stored row rejects at once, then its parent's) go as one message, each the
next one's ``then``. It also remembers whether the draft owes the session a sampled correction
(a rejection whose token the draft draws from the p row it was sent). Decides nothing:
SessionPipeline says what each verdict settled; tests/unit/test_session_parts.py drives it
without models."""

from __future__ import annotations

from svip_common.acceptance import StopRule
from svip_common.contracts import Verdict
from svip_common.messages import DraftedBlock, Feedback
from svip_common.outcome import DRAW, outcome_of


class FeedbackChain:
    def __init__(self, session_id: str):
        self.session_id = session_id
        self.correction_due = False  # the latest feedback asks the draft to draw the correction
        self._queued: list[Feedback] = []  # verdicts whose feedback has not left yet

    def add(self, epoch: int, block: DraftedBlock, verdict: Verdict, token: int, prepared_used: bool,
            deferred: bool, cap: int | None, stop_rule: StopRule | None, node_price: float | None = None,
            next_tokens: int | None = None) -> None:
        """Queue a decided verdict's feedback. token: the place after the accepted tokens as
        settled here (NO_TOKEN: the follow-up settles it when deferred, else the draft draws it
        from the p row), after the verdict's branch if a tree's nodes were taken; cap: load-aware
        speculation's cap on the next blocks; stop_rule: auto's; node_price: a node's price at the load;
        next_tokens: deferred, the follow-up's tokens verified next (as held here); prepared_used, the
        prepared continuation's."""
        feedback = Feedback(
            session_id=self.session_id,
            outcome=outcome_of(epoch, block.base, len(block.tokens), verdict.accepted, token, verdict.branch,
                               deferred, prepared_used, next_tokens),
            load_cap=cap,
            stop_rule=stop_rule,
            p_row=verdict.p_row,
            features=verdict.features,
            features_from=max(verdict.features_from, 0),
            node_price=node_price,
        )
        self.correction_due = feedback.outcome.next == DRAW
        self._queued.append(feedback)

    def take(self) -> Feedback | None:
        """Everything queued, as one message (the earliest verdict first); None if nothing is."""
        if not self._queued:
            return None
        chain, self._queued = self._queued, []
        for earlier, later in zip(reversed(chain[:-1]), reversed(chain[1:])):
            earlier.then = later
        return chain[0]

    def drop(self) -> None:
        """The session is done: what is queued never leaves."""
        self._queued.clear()

    def reset(self) -> None:
        """The session detached: the old draft is owed nothing and owes nothing."""
        self._queued.clear()
        self.correction_due = False

    def take_correction_due(self) -> bool:
        """Whether a correction is due now; it is due once."""
        due, self.correction_due = self.correction_due, False
        return due
