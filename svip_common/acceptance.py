"""The `auto` length policy's model: how likely the target accepts a drafted token, and where a
block stops paying.

A drafted token is described by what the draft knew when it chose it: the entropy H of its q,
q(token) (the top probability when greedy) and its place in the block. Its acceptance, given
that every token before it in the block was accepted, is modelled as logistic in
``features(H, q, index)``; the estimate is fit per model pair on the verdicts the target gives
(``AcceptanceModel``, beside the verifier), starting from a prior measured offline
(coordinator/calibration.py) so the first request is already sensible.

Where a block stops (``StopRule``): after drafting its j-th token, the block has survived so far
with probability S_j = prod p_i; one more token is accepted with S_j * p_(j+1) (p_(j+1) predicted
from the j-th token's features at the next place) and costs tau, in the tokens the target alone
makes in that time (svip_common/step_cost.py). A round's rate is r = tokens / cost, so one more
token raises it while S_j * p_(j+1) >= r * tau: ``stop_at`` = r * tau, set per session from its
measured costs and recent rounds (one decision with the load-aware gate: the same tau). SVIP's
entropy bound, the confidence stop and a constant k are special cases of such a rule.

Lengths only: whatever the rule, every token is still verified, so greedy output is the target's
token for token and sampled output follows its distribution exactly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from svip_common.auto_settings import MAX_AUTO_COST, AutoSettings
from svip_common.errors import InvalidRequest
from svip_common.step_cost import Ewma, StepCost, TargetLoad, token_cost

FEATURES = ("bias", "sqrt_entropy", "entropy", "prob", "index")
INDEX_SCALE = 16  # places in a block beyond this look alike
PRIOR_WEIGHTS = (-2.0, 0.0, 0.0, 4.0, 0.0)  # before any fit: acceptance near the draft's own q(token)
REFIT_EVERY = 64  # new observations between refits
PRIOR_STRENGTH = 1.0  # the prior's pull (an L2 penalty toward it, in observations)
FROZEN_RATE = 1.5  # a fixed rule's stand-in for a session's rate (tokens per target step's cost)


def features(entropy: float, prob: float, index: int) -> tuple[float, ...]:
    h = max(float(entropy), 0.0) if math.isfinite(entropy) else 0.0
    q = min(max(float(prob), 0.0), 1.0) if math.isfinite(prob) else 0.0
    return 1.0, math.sqrt(h), h, q, min(index, INDEX_SCALE) / INDEX_SCALE


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


@dataclass(frozen=True)
class StopRule:
    """Where an `auto` block stops: once S_j * p_(j+1) < stop_at (module docstring)."""

    weights: tuple[float, ...] = PRIOR_WEIGHTS
    stop_at: float = 0.5

    def accept_prob(self, entropy: float, prob: float, index: int) -> float:
        return _sigmoid(sum(w * x for w, x in zip(self.weights, features(entropy, prob, index))))

    def check(self) -> StopRule:
        if len(self.weights) != len(FEATURES) or not all(math.isfinite(w) for w in self.weights):
            raise InvalidRequest(f"an auto stop rule needs {len(FEATURES)} finite weights, got {list(self.weights)}")
        if not math.isfinite(self.stop_at) or not 0.0 <= self.stop_at <= MAX_AUTO_COST:
            raise InvalidRequest(f"an auto stop rule's stop_at must be in [0, {MAX_AUTO_COST}], got {self.stop_at}")
        return self


def fit_logistic(x: torch.Tensor, y: torch.Tensor, prior: torch.Tensor, strength: float = PRIOR_STRENGTH,
                 iterations: int = 8) -> torch.Tensor:
    """Weights of a logistic model of y (in [0, 1]) on x [n, features], pulled toward ``prior``
    (Newton's method on the penalised log-loss; float64)."""
    w = prior.clone()
    eye = torch.eye(x.shape[1], dtype=x.dtype)
    for _ in range(iterations):
        p = torch.sigmoid(x @ w)
        grad = x.T @ (p - y) + strength * (w - prior)
        hess = (x * (p * (1 - p)).unsqueeze(1)).T @ x + strength * eye
        step = torch.linalg.solve(hess, grad)
        w = w - step
        if float(step.abs().max()) < 1e-6:
            break
    return w


class AcceptanceModel:
    """One pair's live estimate (one per decoding kind: greedy and sampled tokens are accepted
    differently): the verdicted tokens of recent blocks, refit every REFIT_EVERY new ones, and
    how well its predictions matched what then happened."""

    def __init__(self, prior: tuple[float, ...] = PRIOR_WEIGHTS, settings: AutoSettings = AutoSettings()):
        self.settings = settings.check()
        self.prior = torch.tensor(prior, dtype=torch.float64)
        self.weights = tuple(float(w) for w in prior)
        self._x: list[tuple[float, ...]] = []
        self._y: list[float] = []
        self._next = 0  # ring position once the window is full
        self._since_fit = 0
        self.observed = 0  # verdicted tokens seen
        self.fits = 0
        self.predicted_sum = 0.0  # sum over verdicted tokens of their acceptance as predicted by the fit of the day
        self.accepted_sum = 0.0  # of them, accepted

    def observe(self, entropies: list[float], probs: list[float], accepted: int) -> None:
        """A verdict: the block's first `accepted` tokens were accepted, the next (if any)
        rejected; the ones after it say nothing (their prefix was rejected)."""
        rule = StopRule(self.weights)
        for i in range(min(accepted + 1, len(entropies), len(probs))):
            x = features(entropies[i], probs[i], i + 1)
            y = 1.0 if i < accepted else 0.0
            self.predicted_sum += rule.accept_prob(entropies[i], probs[i], i + 1)
            self.accepted_sum += y
            self.observed += 1
            if not self.settings.learn:
                continue
            if len(self._x) < self.settings.window:
                self._x.append(x)
                self._y.append(y)
            else:
                self._x[self._next], self._y[self._next] = x, y
                self._next = (self._next + 1) % self.settings.window
            self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self.refit()

    def refit(self) -> None:
        self._since_fit = 0
        if not self._x:
            return
        x = torch.tensor(self._x, dtype=torch.float64)
        y = torch.tensor(self._y, dtype=torch.float64)
        w = fit_logistic(x, y, self.prior)
        if bool(torch.isfinite(w).all()):
            self.weights = tuple(float(v) for v in w)
            self.fits += 1

    def rule(self, stop_at: float) -> StopRule:
        return StopRule(self.weights, stop_at)

    def to_dict(self) -> dict:
        n = max(self.observed, 1)
        return {
            "weights": dict(zip(FEATURES, (round(w, 4) for w in self.weights))),
            "observed_tokens": self.observed, "fits": self.fits, "learn": self.settings.learn,
            "predicted_acceptance": round(self.predicted_sum / n, 4),
            "observed_acceptance": round(self.accepted_sum / n, 4),
        }


class RoundRate:
    """The pair's recent rate: tokens a round settles over what it costs (1 for the target's step,
    tau per drafted token, the round trip), exponentially weighted over every greedy session's
    rounds; 1 until measured."""

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self._tokens = self._cost = 0.0

    def update(self, drafted: int, accepted: int, tau: float, round_tokens: float = 0.0) -> None:
        d = self.decay
        self._tokens = d * self._tokens + accepted + 1
        self._cost = d * self._cost + 1.0 + tau * drafted + round_tokens

    @property
    def value(self) -> float:
        return self._tokens / self._cost if self._cost > 0 else 1.0


class AutoEstimate:
    """A pair's `auto` state beside its verifier: one acceptance model per decoding kind, what a
    drafted token takes on the draft (every session's blocks, exponentially weighted), the rate
    rounds reach, and the prior cost of a drafted token (tau until drafting is measured). Pair-wide,
    so a new session starts from what the ones before it measured."""

    def __init__(self, prior_weights: tuple[float, ...] = PRIOR_WEIGHTS, prior_cost: float = 0.3,
                 settings: AutoSettings = AutoSettings()):
        self.settings = settings.check()
        self.prior_cost = prior_cost
        # sampled tokens: the prior, never refit (their lengths stay fixed, so a seed reproduces
        # its sample); still scored against their verdicts, for the export
        frozen = dataclasses.replace(settings, learn=False)
        self.models = {True: AcceptanceModel(prior_weights, settings), False: AcceptanceModel(prior_weights, frozen)}
        self.rate = RoundRate()
        # a block's drafting time as fixed + per token (its forwards' shares and its work): what one
        # more token costs is the slope, never the average, which counts a block's own overhead
        # (the first forward's pending tokens, the rollback) against its tokens
        self.drafting = StepCost(decay=0.95)

    def model(self, greedy: bool) -> AcceptanceModel:
        return self.models[greedy]

    def record_drafting(self, drafted: int, seconds: float | None) -> None:
        if not drafted or seconds is None or not math.isfinite(seconds) or seconds < 0:
            return
        self.drafting.observe(drafted, seconds)

    @property
    def draft_token_s(self) -> float:
        """What one more drafted token takes on the draft: the slope of a block's drafting time in
        its tokens. Until the blocks' lengths have varied enough to tell it, 0 (as StepCost assumes
        a slope free until it can tell), so the blocks lengthen and the slope is measured. Priced
        at the average instead, a block of one token carried its overhead alone, looked dear, and
        kept the next block at one token (docs/benchmarks.md, the one-token trap)."""
        return self.drafting.per_item

    def cost(self, load: TargetLoad | None) -> float:
        """tau: the configured one, else the measured one at the target's load now, else the prior.
        Measured before the blocks' lengths have varied enough to tell what a drafted token costs
        on the draft, only its verification counts (the draft's share taken as free, as StepCost
        does until it can tell): the blocks lengthen, and their lengths vary, until it can. A
        dear prior, or a stop that kept every block at one token, would never learn otherwise."""
        if self.settings.cost is not None:
            return self.settings.cost
        if load is not None and self.drafting.observed:
            measured = token_cost(load, self.draft_token_s if self.drafting.sloped else 0.0)
            if math.isfinite(measured) and measured > 0:
                return min(measured, MAX_AUTO_COST)
        return self.prior_cost

    def to_dict(self) -> dict:
        return {"prior_cost": round(self.prior_cost, 4), "cost": self.settings.cost, "rate": round(self.rate.value, 4),
                "draft_token_s": round(self.draft_token_s, 6), "draft_block_s": round(self.drafting.fixed, 6),
                "greedy": self.models[True].to_dict(), "sampled": self.models[False].to_dict()}


class SessionStop:
    """One session's `auto` stop: its verdicts go into the pair's estimate, and its next block's
    rule is the pair's weights at stop_at = the pair's recent rate times tau now.

    What a seed reproduces: a greedy session's output is the target's whatever the lengths. A
    sampled one's draw depends on where its blocks end, so its rule is fixed (``frozen``): the
    pair's prior at its prior (or configured) cost times FROZEN_RATE, never the live fit or a
    timed cost; the same seed then gives the same sample for as long as the deployment's prior
    stands (a stored prior: always). With learn off, greedy sessions are frozen too."""

    def __init__(self, estimate: AutoEstimate, greedy: bool):
        self.estimate = estimate
        self.model = estimate.model(greedy)
        self.frozen = not self.model.settings.learn
        self.tau = estimate.cost(None)
        self.round_trip = Ewma(0.2)  # across workers: a waited-for round's time beyond its drafting (wire, queues)

    def rule(self, load: TargetLoad | None = None) -> StopRule:
        if self.frozen:
            return StopRule(tuple(float(w) for w in self.estimate.model(False).prior), FROZEN_RATE * self.tau)
        self.tau = self.estimate.cost(load)
        return self.model.rule(max(self.estimate.rate.value, 1.0) * self.tau)

    def record(self, entropies: list[float], probs: list[float], accepted: int, draft_s: float | None = None,
               round_tokens: float = 0.0, overlapped: bool = False) -> None:
        """A verdict on a block of len(entropies) tokens whose drafting held its session draft_s
        seconds: its share of the draft's forwards, or in async the draft steps it rode over the
        sessions a target step serves (coordinator/session/speculation.py). overlapped: drafted
        while the target verified the block before it (the split pipeline's follow-ups and
        prepared continuations): its round cost the target's step alone, so the
        rate counts no drafted token and no round trip against it, and its drafting time, a share
        of steps that other rows rode, is not what a token of a block the target waits for costs
        (left out of that fit). Measured on the simulated clock, async auto at 32 sessions:
        +4.9% to +7.9% on three pairs (docs/benchmarks.md, sixteenth round)."""
        if entropies:
            self.model.observe(entropies, probs, accepted)
        if not self.frozen:
            if not overlapped:
                self.estimate.record_drafting(len(entropies), draft_s)
            self.estimate.rate.update(len(entropies), accepted, 0.0 if overlapped else self.tau,
                                      0.0 if overlapped else round_tokens)
