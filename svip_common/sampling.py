"""The one logits -> distribution transform, used by the draft for q and by the target for p, so
both pass through exactly the same temperature / top-k / top-p warping (as gpt-fast's single
``logits_to_probs``).

In greedy mode (temperature 0) the distribution is softmax(raw logits): its argmax is the token,
and its entropy is what SVIP reads.
"""

from __future__ import annotations

import torch

from svip_common.contracts import SamplingParams


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [n, vocab] -> probabilities [n, vocab] (float32) after warping."""
    logits = logits.float()
    if params.greedy:
        return torch.softmax(logits, dim=-1)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = _top_p_filter(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def mask_padding(logits: torch.Tensor, limit: int) -> torch.Tensor:
    """logits [n, width] with every column at or past ``limit`` set to -inf, in place: ids that
    no tokenizer entry or no model of the pair has (a checkpoint's padding columns) are never
    chosen, greedy or sampled."""
    if logits.shape[-1] > limit:
        logits[..., limit:] = float("-inf")
    return logits


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [n, vocab]
    probs = torch.softmax(sorted_logits, dim=-1)
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p  # mass before this token
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats over the last axis; zero-probability entries contribute 0."""
    logp = torch.log(probs.clamp_min(1e-30))
    return -(probs * logp).sum(dim=-1)


def sample_index(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from probs [vocab] (need not be normalised) with one uniform u in [0, 1)."""
    return int(sample_indices(probs[None], torch.tensor([u], dtype=torch.float64, device=probs.device))[0])


def sample_indices(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One inverse-CDF draw per row of probs [n, vocab] (rows need not be normalised), row i with
    the uniform u[i] in [0, 1) (float64): [n] ids, with no host read. u * a row's total landing on
    the right edge of a stretch of zeros steps back to the last id before it with mass."""
    cdf = probs.double().cumsum(dim=-1)  # [n, vocab]
    target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]  # [n, 1]
    index = torch.searchsorted(cdf, target, right=True).clamp_max(probs.shape[-1] - 1)  # [n, 1]
    ids = torch.arange(probs.shape[-1], device=probs.device)
    with_mass = torch.where(probs > 0, ids, 0).cummax(dim=-1).values  # the last id at or before with mass
    return with_mass.gather(-1, index)[:, 0]
