"""Recovery's schedule on the target side: when a detached session may take a draft up again. A
draft that stalled under the session waits a backoff before it is handed the session's
re-prefill again (twice as long each time; never again after MAX_STALLS); a sampled session holds
for a replacement until its hold deadline before the target goes on alone; a draft that is back
while a verdict is in flight re-attaches after that verdict. Decides nothing else:
SessionPipeline detaches and attaches; tests drive it with a clock they choose."""

from __future__ import annotations

import enum

REATTACH_BACKOFF_S = 1.0  # a session's first re-attach after a stall waits this long; each next one twice as long
REATTACH_BACKOFF_MAX_S = 30.0
MAX_STALLS = 4  # a draft that stalled this often under one session is not asked to take it up again


class AttachWait(enum.Enum):
    """What a re-attach that a returning draft asked for still waits on."""

    NONE = "none"  # nothing asked, or done
    BACKOFF = "backoff"  # the backoff after a stall: retried once it is over
    VERDICT = "verdict"  # the verdict in flight: taken up once it is decided


class Reattach:
    def __init__(self, hold_s: float):
        self.hold_s = hold_s
        self.stalls = 0  # times the draft stalled under this session: each re-attach waits longer
        self.not_before = 0.0  # a re-attach after a stall waits until then
        self.hold_until: float | None = None  # a detached sampled session waits for a draft until then
        self.waiting = AttachWait.NONE

    @property
    def retired(self) -> bool:
        """The draft stalled under this session too often to be asked again."""
        return self.stalls >= MAX_STALLS

    def detached(self, now: float, stalled: bool, sampled: bool) -> None:
        """The session goes on without its draft; stalled: the draft is connected but too slow."""
        if stalled:
            self.stalls += 1
            self.not_before = now + min(REATTACH_BACKOFF_S * 2 ** (self.stalls - 1), REATTACH_BACKOFF_MAX_S)
        self.hold_until = now + self.hold_s if sampled else None

    def attached(self) -> None:
        self.waiting, self.hold_until = AttachWait.NONE, None

    def hold_over(self, now: float) -> bool:
        """The sampled session's hold for a draft ends now (once)."""
        if self.hold_until is None or now < self.hold_until:
            return False
        self.hold_until = None
        return True

    def backoff_over(self, now: float) -> bool:
        """A re-attach that waited for its backoff is due."""
        return self.waiting is AttachWait.BACKOFF and now >= self.not_before
