"""What a session's protocol asks of its transport, as values: the session (pipeline.py) takes an
event and the time now, and returns these, in order; it never sends, schedules or reads a clock
itself. The host (host.py) carries them out on its compute thread, for the gRPC workers, the Ray
actors and the in-memory transport alike; a test reads them as they are.

    ToDraft(request)       send this to the draft worker (a start, a feedback, a resume, a cancel)
    Verify(block, ...)     verify this block in the next batched target step, then call verified
    Settle(tokens)         these tokens are settled for good: the caller's, in order
    Finish(reason, stats)  the session ended (the last effect it returns)
    DraftAnswered(s)       a draft answer took s seconds (feedback out to block in): the link's
                           stall deadline follows it
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from svip_common.contracts import Block, GenerationStats
from svip_common.messages import DraftedBlock, DraftRequest


@dataclass(frozen=True)
class ToDraft:
    request: DraftRequest


@dataclass(frozen=True)
class Verify:
    block: DraftedBlock  # as the draft sent it
    checked: Block  # what the verifier judges: the block, or its tokens after the target's own
    received_at: float
    source: str  # how it came to be verified: GenerationStats.round_sources
    waited: float | None = None  # a block drafted after a verdict: seconds from the verdict to its arrival


@dataclass(frozen=True)
class Settle:
    tokens: tuple[int, ...]
    logprobs: tuple = ()  # TokenLogprob per token, when the session asked for them


@dataclass(frozen=True)
class Finish:
    reason: str
    final: Callable[[], GenerationStats]  # its statistics, worked out when read (RoundLog.final: on the event
    # loop, where the caller's stream makes its message; nothing writes them after the end)

    @functools.cached_property
    def stats(self) -> GenerationStats:
        return self.final()


@dataclass(frozen=True)
class DraftAnswered:
    seconds: float


Effect = ToDraft | Verify | Settle | Finish | DraftAnswered


def event(method):
    """A session's event: called with the time now before its own arguments, it returns the
    effects it produced, in order. Within one event ``self.now`` is that time (the session reads
    no clock) and ``self._emit`` collects the effects; one event never runs inside another (the
    rule that needs another's work calls its private body)."""

    @functools.wraps(method)
    def run(self, now: float, *args, **kwargs) -> list[Effect]:
        if self._effects is not None:
            raise RuntimeError(f"{method.__name__} called within another event of the session")
        self.now, self._effects = now, []
        try:
            method(self, *args, **kwargs)
            return self._effects
        finally:
            self._effects = None

    return run


class Effects:
    """The part of a session that collects its effects (mixed into SessionPipeline)."""

    now: float = 0.0
    _effects: list[Effect] | None = None

    def _emit(self, effect: Effect) -> None:
        if self._effects is None:
            raise RuntimeError("a session's effect outside of an event")
        self._effects.append(effect)
