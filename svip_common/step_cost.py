"""Load-aware speculation: what one more drafted token costs at the current load, and how many a
session may draft before they cost more than they bring.

A drafted token that the target accepts saves a whole target step for its session; one it rejects
was drafted and verified for nothing. With the target alone, a step of B sessions takes
t(B) = a + b·B seconds and makes B tokens: ``plain_rate`` = B / t(B) tokens per second. A drafted
token costs b in the verification forward plus the session's share of a draft forward (d), so
τ = plain_rate · (b + d) is what it costs in tokens the target alone would have made meanwhile.

- A policy's blocks pay, as they are, when the session's acceptance rate (accepted / drafted)
  is at least τ: then they are left alone (SVIP decides where they end).
- Otherwise they are cut: the j-th token is accepted with probability α^j (α: the per-token
  acceptance rate, each token accepted only if all before it were) and pays while α^j ≥ τ, so a
  block holds at most ⌊ln τ / ln α⌋ tokens; 0 pauses drafting (the target alone).
- Across workers a drafting round also pays a round trip the target alone never does (the block
  out, the feedback back): o seconds, measured per session, during which the target serves the
  other sessions, so it costs R = o / t(B) target steps' worth of tokens for the one session
  (a whole step's worth at B = 1, little in a full batch). The blocks must bring R more than they
  cost: accepted per block ≥ τ·drafted + R, and a cut block pauses when Σ α^j − cap·τ < R.

On an idle GPU b is near zero and τ is the draft/target cost ratio, which any useful draft beats;
when verification turns compute-bound at a large batch, b·plain_rate approaches 1 and blocks
shrink to nothing: the sessions run as the target alone would. The costs are measured, not
configured: the target fits its forwards' time as a + b·tokens online, each session measures
what its drafting took per token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from svip_common.contracts import DRAFT_LENGTH_CAP

UNLIMITED = 1 << 30
MIN_OBSERVATIONS = 4  # steps seen before the fit is trusted (until then: no cap)
# Which requests' blocks follow the load. greedy: greedy ones only (their output is the target's,
# whatever the blocks); a sampled request keeps its policy's lengths, so its seed reproduces it.
# all: sampled ones too (the distribution is still exactly the target's, but a seed then fixes the
# draws, not where blocks end: the same seed may give another sample). off: none.
LOAD_AWARE_MODES = ("off", "greedy", "all")
RESUME_CAP = 2  # a paused session drafts again once this many tokens would pay (hysteresis)
PROBE_TOKENS = 3  # a paused session's probe block
PROBE_FIRST, PROBE_MAX = 4, 32  # paused rounds before the first probe; the interval doubles up to the most


IDLE_PREFILL_MODES = ("auto", "always", "off")  # the target, idle, takes in what waiting sessions need first


def load_aware_for(mode: str, greedy: bool) -> bool:
    """Whether a request (greedy or sampled) drafts no more than pays at the load, under ``mode``."""
    return mode == "all" or (mode == "greedy" and greedy)


class Ewma:
    """An exponentially weighted moving average: the first sample as it is, then each new one
    weighted ``weight``; ``value`` is ``empty`` until the first sample."""

    def __init__(self, weight: float, empty: float | None = 0.0):
        self.weight, self.value, self.samples = weight, empty, 0

    def update(self, sample: float) -> float:
        self.value = sample if not self.samples else (1 - self.weight) * self.value + self.weight * sample
        self.samples += 1
        return self.value


class StepCost:
    """A forward's time as fixed + per_item · items (items: tokens in a verification forward,
    sessions in a draft forward), an exponentially weighted least-squares fit over recent steps."""

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._slope = 0.0  # the last well-determined slope (until items vary, assume it is free)
        self.sloped = False  # whether items have varied enough to tell the slope
        self.items = 0.0  # recent items per step (weighted mean)
        self.steps = 0

    def observe(self, items: int, seconds: float) -> None:
        d = self.decay
        self.steps += 1
        self._n = d * self._n + 1.0
        self._sx = d * self._sx + items
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + items * items
        self._sxy = d * self._sxy + items * seconds
        self.items = self._sx / self._n
        mean_x, mean_y = self._sx / self._n, self._sy / self._n
        spread = self._sxx / self._n - mean_x * mean_x
        if spread >= 0.25:  # items varied enough to tell the slope from noise
            self._slope = max((self._sxy / self._n - mean_x * mean_y) / spread, 0.0)
            self.sloped = True

    @property
    def observed(self) -> bool:
        return self.steps >= MIN_OBSERVATIONS

    @property
    def per_item(self) -> float:
        return self._slope

    @property
    def fixed(self) -> float:
        if not self._n:
            return 0.0
        return max(self._sy / self._n - self._slope * self._sx / self._n, 0.0)

    def time(self, items: float) -> float:
        return self.fixed + self.per_item * items


def row_share(cost: StepCost) -> float:
    """What one more row adds to a step of one, as a share of that step (0 until rows have
    varied enough to tell: a step measured only at one width prices nothing)."""
    one = cost.time(1)
    return cost.per_item / one if cost.sloped and one > 0 else 0.0


@dataclass(frozen=True)
class TargetLoad:
    """What the draft side needs to know about the target's load (sent with each verdict when the
    draft is on another worker)."""

    plain_rate: float  # tokens/s the target alone would make at its current batch
    verify_token_s: float  # seconds one more verified token adds to a target step
    batch: float = 1.0  # sessions per step

    def round_tokens(self, round_overhead_s: float) -> float:
        """R: a drafting round's extra round trip, in tokens the target alone makes meanwhile
        for this session (the target serves the others during it)."""
        return round_overhead_s * self.plain_rate / max(self.batch, 1.0)


def target_load(verify: StepCost, sessions_per_step: float, plain: StepCost | None = None) -> TargetLoad | None:
    """The target's load from a fit of its forwards' time (``verify``) at a batch of
    ``sessions_per_step``. plain: the fit of plain steps alone (one token per session). With it, a
    plain step's time is the measured one, and a drafted token costs at least what the recent
    steps' drafted rows added on average over a plain step of their batch: a forward's time is
    not a line in its tokens (on a CPU the first row past one per session pads every session's
    attention; measured: docs/architecture.md, load-aware speculation), and the line fitted
    through such steps would price a drafted row at its slope alone."""
    if not verify.observed:
        return None
    batch = max(sessions_per_step, 1.0)
    step = verify.time(batch)  # a plain step: one token per session
    per_token = verify.per_item
    if plain is not None and plain.observed:
        step = plain.time(batch)
        extra = verify.items - batch  # drafted rows a recent step verified, beyond one per session
        if extra >= 1.0:
            per_token = max(per_token, (verify.time(verify.items) - step) / extra)
    return TargetLoad(batch / step if step > 0 else 0.0, per_token, batch)


def token_cost(load: TargetLoad, draft_token_s: float) -> float:
    """τ: what one drafted token costs, in tokens the target alone makes in that time."""
    return load.plain_rate * (load.verify_token_s + draft_token_s)


def speculation_cap(load: TargetLoad | None, draft_token_s: float, acceptance: float,
                    block_rate: float | None = None, round_s: float = 0.0, drafted: float = 1.0) -> int:
    """The most tokens worth drafting in a block: no cap while the blocks pay as they are
    (accepted per block ≥ τ·drafted + R, with block_rate = accepted / drafted and ``drafted``
    tokens a block), else ⌊ln τ / ln α⌋ (α = acceptance, per token), and 0 when even that block
    does not bring R more than it costs (R: the round trip, ``round_s`` seconds)."""
    if load is None:
        return UNLIMITED
    tau = token_cost(load, draft_token_s)
    extra = load.round_tokens(round_s)
    if tau <= 0.0 and extra <= 0.0:
        return UNLIMITED
    if block_rate is not None and block_rate * drafted >= tau * drafted + extra:
        return UNLIMITED
    if tau >= 1.0 or acceptance <= 0.0:
        return 0
    cap = UNLIMITED if acceptance >= 1.0 or tau <= 0.0 else int(math.log(tau) / math.log(acceptance))
    if extra > 0.0:
        cap = min(cap, DRAFT_LENGTH_CAP)
        gain = sum(acceptance ** j for j in range(1, cap + 1)) - cap * tau
        if gain < extra:
            return 0
    return cap


class AcceptanceRate:
    """A session's recent acceptance, exponentially weighted from a prior of 4 in 5: ``value``,
    per token (accepted drafted tokens over accepted plus rejections: a block ends in at most
    one), and ``block_rate``, accepted over drafted (vLLM's acceptance rate)."""

    PRIOR = (4.0, 1.0, 5.0)  # accepted, rejections, drafted

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self._accepted, self._rejected, self._drafted = self.PRIOR
        self._blocks = 1.0  # the prior's one block of 5

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        d = self.decay
        self._accepted = d * self._accepted + accepted
        self._rejected = d * self._rejected + (1.0 if accepted < drafted else 0.0)
        self._drafted = d * self._drafted + drafted
        self._blocks = d * self._blocks + 1.0

    def relax(self, weight: float = 0.005) -> None:
        """A round without a verdict to learn from (drafting paused): drift back toward the prior,
        so a session paused for poor acceptance tries again now and then."""
        prior = self.PRIOR
        self._accepted += weight * (prior[0] - self._accepted)
        self._rejected += weight * (prior[1] - self._rejected)
        self._drafted += weight * (prior[2] - self._drafted)

    @property
    def value(self) -> float:
        return self._accepted / (self._accepted + self._rejected)

    @property
    def block_rate(self) -> float:
        return self._accepted / self._drafted

    @property
    def drafted_per_block(self) -> float:
        return self._drafted / self._blocks


class SessionGate:
    """One session's side of load-aware speculation: its acceptance, and what its drafting costs
    per token (its share of the draft's decode forwards, measured where the draft runs and reported
    with each block; a prompt's prefill is not drafting). ``cap(load)``: its next block's longest
    worthwhile length; 0 pauses drafting, which resumes once at least RESUME_CAP tokens pay.

    A paused session keeps probing: every ``probe_every`` paused rounds (PROBE_FIRST, doubling up
    to PROBE_MAX), times the sessions per target step, it drafts one block of PROBE_TOKENS, so its
    acceptance and drafting cost are measured again rather than frozen at the values that paused
    it. A probe costs at most PROBE_TOKENS drafted tokens per PROBE_FIRST rounds, and less the
    longer the pause holds; at a batch of B sessions each probes B times less often, since a probe
    holds up every session of its step (its draft forwards, and on a CPU the padding of the
    step's attention), so the batch as a whole probes as often as one session alone. A paused
    session also resumes without a probe once the load falls (its cap is worked out every round)."""

    def __init__(self, cuts: bool = True, shared_draft_token_s: Ewma | None = None):
        """cuts False: the policy itself stops a block where one more token stops paying at this
        τ (auto), so a block that pays is not cut here; only the pause (and its probes) is decided.
        shared_draft_token_s: what a drafted token cost the sessions before this one (the in-process
        engine's, updated by every gate that shares it): a new session's estimate until its own
        blocks measure it, so that it does not start as if drafting were free (at a batch where it
        does not pay, it then pauses before its draft takes its prompt in)."""
        self.cuts = cuts
        self.acceptance = AcceptanceRate()
        self._draft_token_s = Ewma(0.2)
        self._shared_draft_token_s = shared_draft_token_s
        # a block's drafting time as fixed + per token: one more token costs the slope (the cap's
        # price), once the blocks' lengths have varied enough to tell it; the whole block the average
        self._drafting = StepCost(decay=0.95)
        self._round_s = Ewma(0.2)  # a drafting round's extra round trip (across workers; 0 in one process)
        self.paused = False
        self.pauses = 0
        self.probes = 0
        self._paused_rounds = 0
        self._probe_every = PROBE_FIRST

    def record(self, drafted: int, accepted: int, draft_s: float | None = None) -> None:
        self.acceptance.update(drafted, accepted)
        if draft_s is not None and drafted and math.isfinite(draft_s) and draft_s >= 0:
            self._draft_token_s.update(draft_s / drafted)
            self._drafting.observe(drafted, draft_s)
            if self._shared_draft_token_s is not None:
                self._shared_draft_token_s.update(draft_s / drafted)

    def record_round_trip(self, seconds: float) -> None:
        """What a drafting round spent beyond its forwards (wire, hand-offs), across workers."""
        if math.isfinite(seconds) and seconds >= 0:
            self._round_s.update(seconds)

    @property
    def draft_token_s(self) -> float:
        """What a drafted token took on average (a block's drafting time per token: how long a
        block keeps the target waiting)."""
        if not self._draft_token_s.samples and self._shared_draft_token_s is not None:
            return self._shared_draft_token_s.value
        return self._draft_token_s.value

    @property
    def marginal_draft_token_s(self) -> float:
        """What one more drafted token costs: the slope of a block's drafting time in its tokens
        once the lengths have varied enough to tell it (auto's blocks do), else the average. Priced
        at the average, a block's own overhead (its first forward takes in the verdict's tokens,
        which a pause defers, not saves) fell on its few tokens and paused sessions whose drafting
        paid (docs/benchmarks.md, "the gate's price of a drafted token")."""
        return self._drafting.per_item if self._drafting.sloped else self.draft_token_s

    @property
    def round_s(self) -> float:
        return self._round_s.value

    def cap(self, load: TargetLoad | None) -> int:
        if self.paused:
            self.acceptance.relax()
        a = self.acceptance
        cap = speculation_cap(load, self.marginal_draft_token_s, a.value, a.block_rate, self.round_s,
                              a.drafted_per_block)
        if not self.cuts and cap > 0:
            cap = UNLIMITED
        if self.paused:
            if cap >= RESUME_CAP:
                self.paused, self._probe_every = False, PROBE_FIRST
                return cap
            self._paused_rounds += 1
            # look again (the evidence may be stale), as often as one session alone would across
            # the batch: a probe's block holds up every session of its step
            if self._paused_rounds >= self._probe_every * (load.batch if load is not None else 1.0):
                self._paused_rounds, self._probe_every = 0, min(2 * self._probe_every, PROBE_MAX)
                self.probes += 1
                return PROBE_TOKENS
            return 0
        if cap == 0:
            self.paused, self._paused_rounds = True, 0
            self.pauses += 1
        return cap


def block_wait(gate: SessionGate, waited: float) -> float:
    """The seconds until a session's block is due: its round trip plus its drafting (k tokens, what
    its blocks hold on average), less what it has waited since its verdict (``waited``)."""
    k = max(1.0, gate.acceptance.drafted_per_block)
    return max(0.0, gate.round_s + gate.draft_token_s * k - waited)


def early_row_gain(gate: SessionGate, verify: StepCost) -> float:
    """What a session's next row, taken in while the target idles (``Verifier.prefill_next``),
    saves it in the target's seconds: where the stored row rejects its block's first token at
    once (r, the chance a drafted token is rejected) the block needs no forward of its k tokens,
    and otherwise that forward holds a token fewer: r·F(k) + F(k + 1) - F(k)."""
    k = max(1.0, gate.acceptance.drafted_per_block)
    return (1.0 - gate.acceptance.value) * verify.time(k) + verify.per_item


def prefills_that_pay(candidates: Sequence[tuple[int, float]], waits: Sequence[float], verify: StepCost,
                      owed: int = 0) -> list[int]:
    """Which sessions a forward takes in while the target idles, waiting on blocks (indices into
    ``candidates``: each session's (rows it takes in, early_row_gain)): of those that save the most
    a row, the most that save more than the forward adds to the waits of the blocks due (``waits``:
    every waiting session's block_wait, the chosen included), Σ gain > Σ_j max(0, F(rows) - W_j),
    beyond what the ``owed`` rows (prompts not yet taken in: that forward is owed anyway) add. At
    one session: max(0, F(1) - W) < r·F(k) + F(k + 1) - F(k), a prefill that pays where the block
    comes later than a one-token forward (a CPU's drafts) and rarely where it comes at once. With
    several, a forward that would hold up a block due now runs only if its rows save more; one
    that ends before the blocks come is free. Nothing until the target's forwards are measured."""
    if not verify.observed:
        return []

    def held(rows: int) -> float:  # what a forward of these rows adds to the blocks' waits (none: no forward)
        return sum(max(0.0, verify.time(rows) - wait) for wait in waits) if rows else 0.0

    order = sorted(range(len(candidates)), key=lambda i: -candidates[i][1] / max(candidates[i][0], 1))
    owed_held = held(owed)
    best, best_net, rows, saved = 0, 0.0, owed, 0.0
    for taken, i in enumerate(order, 1):
        rows, saved = rows + candidates[i][0], saved + candidates[i][1]
        net = saved - (held(rows) - owed_held)
        if net > best_net:
            best, best_net = taken, net
    return sorted(order[:best])
