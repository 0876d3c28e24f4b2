"""When the target's batched step waits for a block about to come (issue 60).

With blocks ready, a step may start now or a moment later with the blocks of sessions whose
drafts are drafting them after a verdict. A session whose block misses the step waits a whole
forward for the next one (riding it for one token where it can), so at a target that verifies
many sessions at once, with a draft that sends a new block soon after each verdict (a 1B draft
beside a 70B target: a median 1.6 ms against a 16 ms forward), half the sessions used to sit each
forward out. Holding pays where the tokens the blocks bring outweigh the time the step loses:

    hold h maximising  (S + Σ_i g_i · P_i(h)) / (F + h),  and only if that beats S / F

with F the step's forward, S what its ready blocks settle, g_i what session i's block adds to it
(what a verified block settles, less the token its row would settle riding), and P_i(h) the chance
its block arrives within h, read off the recent delays from a verdict to the block that followed
it (``BlockArrivals``), given that it has waited w_i already: #{w_i < d ≤ w_i + h} / #{d > w_i}.
Nothing is a constant of the pair: F from the target's measured forwards, S and g_i from its
verdicts, P_i from the arrivals. Where the draft is slow against a forward (an 8B's two steps
against a 70B's forward) the blocks mostly come too late to pay; where it is quick (a 1B's) the
step waits a millisecond or two for most of them. Pure: the host (coordinator/session/idle_work.py)
decides with it; numbers in docs/benchmarks.md ("The target's step waits for blocks about to come").
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

WINDOW = 64  # the recent verdict-to-block delays an arrival's chance is read from
MIN_SAMPLES = 8  # fewer seen: the step never waits
MIN_HOLD_S = 1e-5  # a shorter hold is none (below any clock's step between two arrivals)


class BlockArrivals:
    """The recent delays from a verdict to the block its session's draft sent after it, as the
    target received them (link, the draft's queue and its drafting in one number)."""

    def __init__(self, window: int = WINDOW):
        self._delays: collections.deque[float] = collections.deque(maxlen=window)

    def observe(self, delay_s: float) -> None:
        self._delays.append(max(0.0, delay_s))

    @property
    def known(self) -> bool:
        return len(self._delays) >= MIN_SAMPLES

    def hold_s(self, waiting: Sequence[tuple[float, float]], forward_s: float, settles: float,
               most_s: float | None = None) -> float:
        """The seconds to hold the step (0: start it now). waiting: each session waiting on its
        draft's block after a verdict, (seconds it has waited, tokens its block adds to the step
        if it comes in time); forward_s: the step's forward as it stands; settles: the tokens its
        ready blocks settle; most_s: the longest hold allowed (None: the forward's time; a hold never
        exceeds the forward it delays)."""
        most_s = forward_s if most_s is None else min(most_s, forward_s)
        if not self.known or not waiting or forward_s <= 0.0 or most_s <= MIN_HOLD_S:
            return 0.0
        delays = np.fromiter(self._delays, dtype=np.float64)
        waited = np.array([w for w, _ in waiting], dtype=np.float64)[:, None]
        gains = np.array([max(g, 0.0) for _, g in waiting], dtype=np.float64)[:, None]
        after = delays[None, :] - waited  # each seen delay, as an arrival from now
        later = after > 0.0  # the delays still possible for that session
        share = gains / np.maximum(later.sum(axis=1, keepdims=True), 1)  # each arrival's part of its gain
        soon = later & (after > MIN_HOLD_S) & (after <= most_s)
        holds, adds = after[soon], np.broadcast_to(share, after.shape)[soon]
        if holds.size == 0:
            return 0.0
        order = np.argsort(holds, kind="stable")
        holds, expected = holds[order], np.cumsum(adds[order])
        rates = (settles + expected) / (forward_s + holds)
        best = int(np.argmax(rates))
        return float(holds[best]) if float(rates[best]) > settles / forward_s else 0.0
