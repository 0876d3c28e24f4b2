"""A distributed session's statistics, kept beside its protocol: each round's parts (what the
target waited for on the draft, transit, queueing, the forward, overhead), the workers' busy
intervals, the bytes on the wire, and the final figures (busy, overlap, bubbles, timeline).
Nothing here decides anything; tests/unit/test_round_log.py checks it without models."""

from __future__ import annotations

from svip_common.contracts import GenerationStats
from svip_common.messages import DraftedBlock


class RoundLog:
    def __init__(self, started: float):
        self.stats = GenerationStats()
        self.started = self.last_decision = started
        self.intervals: list[tuple[str, float, float]] = []  # (worker, start, end), wall clock
        self.wire_bytes = 0

    def busy(self, worker: str, start: float, end: float) -> None:
        self.intervals.append((worker, start, end))

    def round(self, block: DraftedBlock, accepted: int, timing: tuple[float, float, float, str], now: float) -> None:
        """A decided round. timing: (block received, forward started, forward ended, source)."""
        (received_at, started, ended, source), s, last = timing, self.stats, self.last_decision
        wall = now - last
        # the part of this block's drafting that the target waited for
        critical_draft = (
            min(block.draft_s, max(0.0, block.finished_at - max(block.started_at, last))) if block.tokens else 0.0
        )
        entropies = block.block.entropies
        s.record_round(len(block.tokens), accepted, entropies[-1] if block.tokens and entropies else None)
        s.target_forwards += 1
        s.round_s.append(wall)
        s.draft_forward_s.append(critical_draft)
        s.target_forward_s.append(ended - started)
        s.block_transit_s.append(max(0.0, received_at - block.finished_at) if block.finished_at else 0.0)
        s.target_queue_s.append(max(0.0, started - max(received_at, last)))
        s.feedback_transit_s.append(0.0)  # filled in when the draft answers this round's feedback
        s.draft_queue_s.append(0.0)
        s.overhead_s.append(max(0.0, wall - (ended - started) - critical_draft))
        s.round_sources.append(source)
        self.last_decision = now

    def feedback_answered(self, block: DraftedBlock, feedback_sent_at: float) -> None:
        """The latest round's return trip, now that a block answering its feedback arrived."""
        if self.stats.rounds:
            self.stats.feedback_transit_s[-1] = max(0.0, block.trigger_at - feedback_sent_at)
            self.stats.draft_queue_s[-1] = max(0.0, block.started_at - block.trigger_at)

    def final(self, has_draft: bool, now: float) -> GenerationStats:
        s = self.stats
        s.wall_s = now - self.started
        draft = [(a, b) for w, a, b in self.intervals if w == "draft"]
        target = [(a, b) for w, a, b in self.intervals if w == "target"]
        s.draft_forwards = s.draft_tokens + s.discarded_tokens
        s.draft_busy_s = sum(b - a for a, b in draft)
        s.target_busy_s = sum(b - a for a, b in target)
        s.both_busy_s = overlap(draft, target)
        s.draft_wait_s = max(0.0, s.wall_s - s.draft_busy_s) if has_draft else 0.0
        s.target_wait_s = max(0.0, s.wall_s - s.target_busy_s)
        s.wire_bytes = self.wire_bytes
        s.wire_bytes_per_round = s.wire_bytes / s.rounds if s.rounds else 0.0
        s.timeline = [(w, a - self.started, b - self.started) for w, a, b in sorted(self.intervals, key=lambda x: x[1])]
        return s


def overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Total time covered by both interval sets (each set's intervals are disjoint)."""
    total, i, j = 0.0, 0, 0
    xs, ys = sorted(xs), sorted(ys)
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total
