"""A verdict as the target's feedback carries it, built from its parts (the draft's protocol tests
drive PipelinedDraft.on_feedback with these): the outcome the target would have decided for them
(svip_common/outcome.py), an inconsistent one refused as the wire refuses it."""

from __future__ import annotations

from svip_common.contracts import NO_TOKEN
from svip_common.messages import Feedback
from svip_common.outcome import outcome_of


def feedback_of(epoch: int, base: int, drafted: int, accepted: int, token: int, p_row=None, prepared_used=False,
                load_cap: int | None = None, branch: tuple[int, ...] = (), session_id: str = "s") -> Feedback:
    deferred = accepted == drafted and token == NO_TOKEN and not prepared_used
    outcome = outcome_of(epoch, base, drafted, accepted, token, tuple(branch), deferred, prepared_used)
    return Feedback(session_id, outcome, load_cap=load_cap, p_row=p_row)


def apply_verdict(draft, now: float, epoch: int, base: int, drafted: int, accepted: int, token: int, p_row,
                  prepared_used: bool, received_at: float, load_cap: int | None = None, features=None,
                  features_from: int = 0, branch: tuple[int, ...] = ()) -> list:
    """draft.on_feedback of the feedback these parts make."""
    feedback = feedback_of(epoch, base, drafted, accepted, token, p_row, prepared_used, load_cap, branch)
    return draft.on_feedback(now, feedback, received_at, features, features_from)
