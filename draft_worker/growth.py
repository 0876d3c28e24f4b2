"""A follow-up that grows at the target until it is verified (async, greedy chains and flat trees,
each growth's places with their siblings): part of the draft session's protocol (pipelined.py),
pure, on the draft worker's compute thread.

The follow-up (the block drafted on top of the one being verified) is sent at the first stop its
policy makes, and drafted on past it while another forward ends before its verdict is due
(``VerdictTiming``, as any block drafted past a stop): after each forward the tokens it added go to
the target, which appends them to the follow-up it holds. When the verdict before it accepts the block whole,
the target verifies the follow-up as it holds it then, and its feedback says how many tokens that
was (``Outcome.next_tokens``); what the draft drafted past them (in flight, or not yet sent) is
the next follow-up's start, sent at once and grown on (a greedy chain drafted on from the cut
would draft exactly those tokens again: they are kept, not redrafted). A follow-up that reaches the target
only after that verdict is verified as first sent: the target appends nothing to a block it does
not hold, so then the draft counts its first length.

Why: the verdict's time cannot be known here to the step (the target's forwards, other sessions'
blocks, the queue before a forward), and a follow-up that is still being drafted when the verdict
comes misses the target's next forward: at several sessions the target does not wait, and the
session sits a whole forward out. Sent at its stop, the follow-up is always there, however wrong
the estimate; grown, it holds what the draft wrote in the verification's shadow. Drafting on
until the verdict itself measured the same on the simulated clock and cost the target CPU time
where the draft shares its cores (docs/benchmarks.md, a follow-up that grows)."""

from __future__ import annotations

from svip_common.errors import InvalidRequest
from svip_common.messages import DraftedBlock


def growth_of(item: DraftedBlock, start: int, finished_at: float) -> DraftedBlock:
    """The tokens of item's block past its first ``start``, as a growth of the block the target
    holds of it: named by that block's base, holding ``start`` tokens already (``grows``). A
    follow-up's here; a prepared continuation sent before it ended (stepping.py) keeps its key."""
    tail = item.block.after(start)
    tail.base = item.block.base
    return DraftedBlock(tail, item.followup, prepared_for=item.prepared_for, started_at=item.started_at,
                        finished_at=finished_at, grows=start)


class Growth:
    """The follow-up sent and still drafted on, and how far the target has it."""

    def __init__(self):
        self.job = None  # the pipelined.Job drafting it on (None: none grows)
        self.item: DraftedBlock | None = None  # as sent (its block is the job's: it grows with it)
        self.first = 0  # its tokens when first sent
        self.sent = 0  # its tokens sent so far

    def start(self, job, item: DraftedBlock) -> None:
        self.job, self.item, self.first = job, item, len(item.tokens)
        self.sent = self.first

    def grows(self, job) -> bool:
        return job is not None and job is self.job

    def more(self, finished_at: float, followup: bool) -> DraftedBlock | None:
        """The tokens drafted since the last sent, as a growth of the follow-up (None: none);
        followup: whether a block will come on top of it as it stands now."""
        item = self.item
        block, start = item.block, self.sent
        if len(block.tokens) <= start:
            return None
        self.sent, item.followup = len(block.tokens), followup
        return growth_of(item, start, finished_at)

    def verified_at(self, item: DraftedBlock, next_tokens: int | None) -> tuple[bool, DraftedBlock | None]:
        """The verdict before ``item`` accepted that block whole: the target verifies
        ``next_tokens`` of it (None: all it holds, which for a follow-up that grew here is what
        was first sent). A grown follow-up is cut there and grows no more. Returns whether it was
        one, and what the draft drafted past the cut (None: nothing): the next follow-up's start,
        the tokens a follow-up begun at the cut would draft (a greedy chain), so none is drafted
        again. The job drafting it on, if any, goes on as that one (its block split at the cut)."""
        grown = item is self.item
        keep = next_tokens if next_tokens is not None else (self.first if grown else len(item.tokens))
        if keep > len(item.tokens) or (not grown and keep != len(item.tokens)):
            raise InvalidRequest(f"feedback verifies {keep} tokens of a follow-up of {len(item.tokens)} this "
                                 "session sent")
        if not grown:
            return False, None
        block, rest = item.block, None
        if keep < len(block.tokens):
            if self.job is not None:  # its block becomes the tokens past the cut, and grows on
                self.job.draft.split_off(keep)
                tail, alternatives = self.job.draft.block, self.job.draft.alternatives
            else:
                tail, alternatives = block.after(keep), item.alternatives[keep:]
            rest = DraftedBlock(tail, False, started_at=item.started_at, alternatives=alternatives)
        block.keep_first(keep)
        del item.alternatives[keep:]
        self.clear()
        return True, rest

    def finish(self) -> None:
        """Its job is done (the cap, a stop token): nothing more grows, the block stays as sent."""
        self.job = None

    def clear(self) -> None:
        self.job, self.item, self.first, self.sent = None, None, 0, 0
