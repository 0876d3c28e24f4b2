"""Offline calibration for a model pair: `--threshold auto` (SVIP's threshold) and the prior of
the `auto` policy (``auto_prior``).

Entropy scales differ between pairs and tokenisers, so the paper's 0.3 (tuned on Qwen and Llama)
can stop far too early or too late elsewhere. Calibration measures, for the pair at hand:

1. how acceptance depends on the draft's entropy: the target decodes a few prompts greedily, and
   one teacher-forced draft pass over each continuation gives, per position, the draft's entropy
   H_i and whether its argmax matches the target's token (m_i);
2. the costs, timed on this machine, in units of one target forward of one token: a draft
   forward (c), and each extra token the target verifies in the same forward (v; near 0 on a
   GPU, where a forward is memory-bound, but not on a CPU);

then replays SVIP offline on those trajectories for a grid of thresholds and keeps the one with
the least modelled time per token, sum over rounds of (1 + (v + c) * drafted) / emitted. Only
block lengths change with the threshold, never which tokens are emitted, so exactness is
untouched.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from draft_worker.policies import svip_stops
from svip_common.acceptance import PRIOR_WEIGHTS, AutoEstimate, features, fit_logistic
from svip_common.auto_settings import AutoSettings
from svip_common.kv_cache import KVCache
from svip_common.models import LoadedModel
from svip_common.sampling import entropy

CALIBRATION_PROMPTS = (
    "def parse_args(argv):\n    \"\"\"Parse the command line.\"\"\"\n",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n",
    "The history of the city begins in the twelfth century, when",
    "Question: What is the capital of France?\nAnswer:",
    "Translate to German: The weather is nice today.\n",
    "Summarize the following text in one sentence. Speculative decoding uses a small model",
    "for i in range(10):\n",
    "Once upon a time, there was a",
)
THRESHOLD_GRID = tuple(round(0.02 * i, 2) for i in range(1, 101))  # 0.02 .. 2.0


@dataclass
class Trajectory:
    """A draft model's teacher-forced pass over the target's continuation: a block drafted at any
    place sees the target's tokens before it, so it is a slice of this one pass."""

    entropies: list[float]  # draft entropy at each position of the target's continuation
    matches: list[bool]  # draft argmax == target token there
    probs: list[float] = field(default_factory=list)  # the draft's top probability there (its q(token) greedy)

    def __len__(self) -> int:
        return len(self.matches)

    def block(self, start: int, cap: int) -> tuple[list[float], list[bool], int]:
        """A block drafted at ``start``: its entropies and matches, and its length if nothing stops it."""
        entropies, matches = self.entropies[start : start + cap], self.matches[start : start + cap]
        return entropies, matches, len(matches)


@dataclass(frozen=True)
class CostModel:
    """Round cost in one-token target forwards: 1 + (verify_slope + draft_ratio) * drafted."""

    draft_ratio: float
    verify_slope: float = 0.0

    def round_cost(self, drafted: int) -> float:
        return 1.0 + (self.verify_slope + self.draft_ratio) * drafted


@dataclass
class Calibration:
    threshold: float
    entropy_scale: float
    cost_ratio: float
    tokens: int  # positions the estimate rests on
    verify_slope: float = 0.0
    time_per_token: dict[float, float] = field(default_factory=dict)  # threshold -> modelled cost

    @property
    def entropy_cut(self) -> float:
        """The learnt rule as an entropy bound: stop once H > threshold^2 / entropy_scale."""
        return self.threshold**2 / self.entropy_scale

    def threshold_for(self, entropy_scale: float) -> float:
        """The same entropy bound expressed for a request's own entropy_scale."""
        return math.sqrt(entropy_scale * self.entropy_cut)

    def to_dict(self) -> dict:
        return {
            "threshold": self.threshold,
            "entropy_scale": self.entropy_scale,
            "cost_ratio": round(self.cost_ratio, 4),
            "verify_slope": round(self.verify_slope, 4),
            "tokens": self.tokens,
        }


@torch.inference_mode()
def greedy_continuation(target: LoadedModel, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """The target's own greedy continuation of the prompt (up to its first stop id)."""
    with KVCache(target.model) as cache:
        logits = cache.forward(prompt_ids, logits_to_keep=1)
        continuation = []
        for _ in range(new_tokens):
            token = int(torch.argmax(logits[-1]))
            continuation.append(token)
            if token in target.eos_token_ids:
                break
            logits = cache.forward([token], logits_to_keep=1)
    return continuation


@torch.inference_mode()
def record_trajectory(target: LoadedModel, draft: LoadedModel, prompt_ids: list[int], new_tokens: int) -> Trajectory:
    continuation = greedy_continuation(target, prompt_ids, new_tokens)
    sequence = torch.tensor([prompt_ids + continuation])  # [1, n]
    draft_logits = draft.model(input_ids=sequence).logits[0, len(prompt_ids) - 1 : -1]  # [m, vocab]
    draft_logits = draft_logits[:, : target.vocab_size].float()
    probs = torch.softmax(draft_logits, dim=-1)
    top = probs.max(dim=-1)
    return Trajectory(
        entropies=entropy(probs).tolist(),
        matches=(top.indices == torch.tensor(continuation)).tolist(),
        probs=top.values.tolist(),
    )


def replay_svip(traj, threshold: float, scale: float, cap: int, cost: CostModel) -> tuple[float, int]:
    """Modelled (cost in target forwards, emitted tokens) of SVIP along one trajectory (a
    Trajectory, or a feature head's chains: coordinator/head_calibration.py)."""
    n, start, total, emitted = len(traj), 0, 0.0, 0
    while start < n:
        entropies, matches, unstopped = traj.block(start, cap)
        drafted = accepted = 0
        rejected = stopped = False
        for h, match in zip(entropies, matches):
            drafted += 1
            rejected = rejected or not match
            accepted += not rejected
            if svip_stops(h, scale, threshold):
                stopped = True
                break
        drafted = drafted if stopped else unstopped
        total += cost.round_cost(drafted)
        emitted += accepted + 1
        start += accepted + 1
    return total, emitted


def choose_threshold(trajs: list, scale: float, cap: int, cost: CostModel) -> tuple[float, dict]:
    table = {}
    for threshold in THRESHOLD_GRID:
        totals = [replay_svip(t, threshold, scale, cap, cost) for t in trajs]
        table[threshold] = sum(c for c, _ in totals) / max(1, sum(e for _, e in totals))
    best = min(table, key=lambda t: (table[t], t))
    return best, table


PRIOR_TOKENS = 48  # per calibration prompt: the draft's own greedy continuation the prior is fit on


@torch.inference_mode()
def auto_prior(target: LoadedModel, draft: LoadedModel, settings: AutoSettings = AutoSettings(),
               prompts: tuple[str, ...] = CALIBRATION_PROMPTS, new_tokens: int = PRIOR_TOKENS) -> AutoEstimate:
    """`auto`'s starting point for a pair (about a second on a CPU): the draft continues each
    prompt greedily, one teacher-forced target forward over that text says where the target's
    argmax agrees (the greedy acceptance of each drafted token, its prefix given), a logistic fit
    of agreement on the draft's features there gives the prior weights, and the forwards' timed
    costs the prior tau (svip_common/acceptance.py)."""
    rows, labels = [], []
    for prompt in prompts:
        ids = list(target.tokenizer(prompt)["input_ids"])
        cache = KVCache(draft.model)
        logits = cache.forward(ids, logits_to_keep=1)
        drafted, feats = [], []
        for index in range(new_tokens):
            q = torch.softmax(logits[-1, : target.vocab_size].float(), dim=-1)
            token = int(torch.argmax(q))
            drafted.append(token)
            feats.append(features(float(entropy(q)), float(q[token]), 1))  # no block here: place 1
            logits = cache.forward([token], logits_to_keep=1)
        with KVCache(target.model) as target_cache:  # one forward over the text (the pool's: a shard's too)
            target_logits = target_cache.forward(ids + drafted, logits_to_keep=len(drafted) + 1)[:-1]
        agree = (torch.argmax(target_logits[:, : target.vocab_size], dim=-1) == torch.tensor(drafted)).tolist()
        rows += feats
        labels += [1.0 if a else 0.0 for a in agree]
    prior = torch.tensor(PRIOR_WEIGHTS, dtype=torch.float64)
    weights = fit_logistic(torch.tensor(rows, dtype=torch.float64), torch.tensor(labels, dtype=torch.float64), prior)
    cost = measure_costs(target, draft, repeats=5)
    return AutoEstimate(tuple(float(w) for w in weights), cost.draft_ratio + cost.verify_slope, settings)


@torch.inference_mode()
def forward_time(model, tokens: int = 1, context: int = 64, repeats: int = 15) -> float:
    """Median time of one forward of `tokens` tokens after a warm cache of `context`."""
    times = []
    with KVCache(model) as cache:
        cache.forward(list(range(1, context + 1)), logits_to_keep=1)
        for i in range(repeats):
            _sync(model)
            start = time.perf_counter()
            cache.forward([i + 1 + j for j in range(tokens)], logits_to_keep=tokens)
            _sync(model)
            times.append(time.perf_counter() - start)
            cache.rollback(context)
    return statistics.median(times)


def measure_cost_ratio(target: LoadedModel, draft: LoadedModel) -> float:
    """One-token forward time, draft over target."""
    return forward_time(draft.model) / forward_time(target.model)


def measure_costs(target: LoadedModel, draft: LoadedModel, block: int = 8, repeats: int = 15) -> CostModel:
    return costs_beside(target, forward_time(draft.model, repeats=repeats), block, repeats)


def costs_beside(target: LoadedModel, draft_step_s: float, block: int = 8, repeats: int = 15) -> CostModel:
    """The cost model for a draft whose one-token step takes draft_step_s, timed beside the target's
    one-token forward and its (block + 1)-token one."""
    one = forward_time(target.model, repeats=repeats)
    many = forward_time(target.model, tokens=block + 1, repeats=repeats)
    return CostModel(draft_ratio=draft_step_s / one, verify_slope=max(0.0, (many - one) / block / one))


def _sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def calibrate(
    target: LoadedModel,
    draft: LoadedModel,
    prompts: tuple[str, ...] = CALIBRATION_PROMPTS,
    new_tokens: int = 96,
    entropy_scale: float = 0.15,
    cap: int = 40,
) -> Calibration:
    trajs = [
        record_trajectory(target, draft, list(target.tokenizer(p)["input_ids"]), new_tokens) for p in prompts
    ]
    return fit_threshold(trajs, measure_costs(target, draft), entropy_scale, cap)


def fit_threshold(trajs: list, cost: CostModel, entropy_scale: float, cap: int) -> Calibration:
    """The threshold with the least modelled time per token over these trajectories (or a head's chains)."""
    threshold, table = choose_threshold(trajs, entropy_scale, cap, cost)
    return Calibration(
        threshold=threshold, entropy_scale=entropy_scale, cost_ratio=cost.draft_ratio,
        tokens=sum(len(t) for t in trajs), verify_slope=cost.verify_slope, time_per_token=table,
    )
