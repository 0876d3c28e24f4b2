"""`--threshold auto`: learn SVIP's threshold for a model pair.

Entropy scales differ between pairs and tokenisers, so the paper's 0.3 (tuned on Qwen and Llama)
can stop far too early or too late elsewhere. Calibration measures, for the pair at hand:

1. how acceptance depends on the draft's entropy: the target decodes a few prompts greedily, and
   one teacher-forced draft pass over each continuation gives, per position, the draft's entropy
   H_i and whether its argmax matches the target's token (m_i);
2. the pair's cost ratio c = draft forward time / target forward time, timed on this machine;

then replays SVIP offline on those trajectories for a grid of thresholds and keeps the one with
the least modelled time per token, (rounds + c * drafted) / emitted. Only block lengths change
with the threshold, never which tokens are emitted, so exactness is untouched.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

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
    entropies: list[float]  # draft entropy at each position of the target's continuation
    matches: list[bool]  # draft argmax == target token there


@dataclass
class Calibration:
    threshold: float
    entropy_scale: float
    cost_ratio: float
    tokens: int  # positions the estimate rests on
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
            "tokens": self.tokens,
        }


@torch.inference_mode()
def record_trajectory(target: LoadedModel, draft: LoadedModel, prompt_ids: list[int], new_tokens: int) -> Trajectory:
    cache = KVCache(target.model)
    logits = cache.forward(prompt_ids, logits_to_keep=1)
    continuation = []
    for _ in range(new_tokens):
        token = int(torch.argmax(logits[-1]))
        continuation.append(token)
        if token in target.eos_token_ids:
            break
        logits = cache.forward([token], logits_to_keep=1)
    sequence = torch.tensor([prompt_ids + continuation])  # [1, n]
    draft_logits = draft.model(input_ids=sequence).logits[0, len(prompt_ids) - 1 : -1]  # [m, vocab]
    draft_logits = draft_logits[:, : target.vocab_size].float()
    probs = torch.softmax(draft_logits, dim=-1)
    return Trajectory(
        entropies=entropy(probs).tolist(),
        matches=(torch.argmax(probs, dim=-1) == torch.tensor(continuation)).tolist(),
    )


def replay_svip(traj: Trajectory, threshold: float, scale: float, cap: int, cost_ratio: float) -> tuple[float, int]:
    """Modelled (cost in target forwards, emitted tokens) of SVIP along one trajectory."""
    n, start, cost, emitted = len(traj.matches), 0, 0.0, 0
    while start < n:
        drafted = accepted = 0
        rejected = False
        for i in range(start, min(n, start + cap)):
            drafted += 1
            rejected = rejected or not traj.matches[i]
            accepted += not rejected
            if math.sqrt(scale * traj.entropies[i]) > threshold:
                break
        cost += 1.0 + cost_ratio * drafted
        emitted += accepted + 1
        start += accepted + 1
    return cost, emitted


def choose_threshold(trajs: list[Trajectory], scale: float, cap: int, cost_ratio: float) -> tuple[float, dict]:
    table = {}
    for threshold in THRESHOLD_GRID:
        totals = [replay_svip(t, threshold, scale, cap, cost_ratio) for t in trajs]
        table[threshold] = sum(c for c, _ in totals) / max(1, sum(e for _, e in totals))
    best = min(table, key=lambda t: (table[t], t))
    return best, table


@torch.inference_mode()
def measure_cost_ratio(target: LoadedModel, draft: LoadedModel, context: int = 64, repeats: int = 15) -> float:
    """Median one-token forward time with a warm cache, draft over target."""

    def one_token_time(model) -> float:
        cache = KVCache(model)
        cache.forward(list(range(1, context + 1)), logits_to_keep=1)
        times = []
        for i in range(repeats):
            _sync(model)
            start = time.perf_counter()
            cache.forward([i + 1], logits_to_keep=1)
            _sync(model)
            times.append(time.perf_counter() - start)
            cache.rollback(context)
        return statistics.median(times)

    return one_token_time(draft.model) / one_token_time(target.model)


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
    ratio = measure_cost_ratio(target, draft)
    threshold, table = choose_threshold(trajs, entropy_scale, cap, ratio)
    return Calibration(threshold, entropy_scale, ratio, sum(len(t.matches) for t in trajs), table)
