"""The one logits -> distribution transform, used by the draft for q and by the target for p, so
both pass through exactly the same temperature / top-k / top-p warping (as gpt-fast's single
``logits_to_probs``).

In greedy mode (temperature 0) the distribution is softmax(raw logits): its argmax is the token,
and its entropy is what SVIP reads.
"""

from __future__ import annotations

import numpy as np
import torch

from svip_common.contracts import SamplingParams

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
FLOAT32_LOWEST = float(torch.finfo(torch.float32).min)


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [n, vocab] -> probabilities [n, vocab] (float32) after warping."""
    logits = logits.float()
    if params.greedy:
        return torch.softmax(logits, dim=-1)
    # past float32's largest value a temperature becomes inf in the division, and -inf / inf (a
    # padding or filtered column) is NaN: at this cap every finite logit is already ~0 (uniform)
    logits = logits / min(params.temperature, FLOAT32_MAX)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = _top_p_filter(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def add_bias(rows: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """rows [n, width] with a request's logit_bias added at its ids, every row alike (a new
    tensor; the rows themselves when there is none). A request's rules apply it with the rest of
    its knobs (row_rules.RowRules)."""
    if not bias:
        return rows
    ids = torch.tensor([token for token, _ in bias], dtype=torch.long, device=rows.device)
    values = torch.tensor([value for _, value in bias], dtype=rows.dtype, device=rows.device)
    out = rows.clone()
    out[..., ids] += values
    return out


def mask_padding(logits: torch.Tensor, limit: int) -> torch.Tensor:
    """logits [n, width] with every column at or past ``limit`` set to -inf, in place: ids that
    no tokenizer entry or no model of the pair has (a checkpoint's padding columns) are never
    chosen, greedy or sampled."""
    if logits.shape[-1] > limit:
        logits[..., limit:] = float("-inf")
    return logits


# On a CPU a row's nucleus is looked for among its most likely tokens, this many first, then the
# next number, then all of them (a sort): torch.sort of a whole vocabulary row costs ~2 ms at 32k
# ids on a CPU core, topk of 64 about a tenth of that, and most rows' nuclei are far smaller (the
# embedded target on Spec-Bench, T=0.7, top-p 0.9: median 9 tokens, p99 130). Each escalation is
# decided by a host read, which on a CPU waits for nothing; on another device it would stall the
# queue, and a sort is cheap there: one sort, no read.
TOP_P_CANDIDATES = (64, 512, 4096)
HOST_DEVICES = ("cpu",)  # where reading a tensor waits on nothing


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one), and
    every token tied with the least likely of them (so the set does not depend on how a sort
    orders ties). A token's mass is its share of the whole row's (logsumexp over every id). Each
    row's set is its own, whatever the rows beside it, and the same by either search below."""
    total = torch.logsumexp(logits, dim=-1, keepdim=True)  # [n, 1]
    if logits.device.type in HOST_DEVICES:
        floor = _floor_among_candidates(logits, total, top_p)
    else:
        floor, _ = _floor(torch.sort(logits, dim=-1, descending=True).values, total, top_p)
    return logits.masked_fill(logits < floor, float("-inf"))


def _floor(values: torch.Tensor, total: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """values [n, k]: rows' most likely logits, descending; total [n, 1] their logsumexp. The least
    likely logit each row keeps [n, 1], and how many of the k it keeps [n, 1] (k: it may go on)."""
    mass = torch.exp(values - total).cumsum(dim=-1)  # non-decreasing, rounding and all
    before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=-1)  # the mass before each
    # compared in float64: a top_p under float32's smallest subnormal (1e-46, say) would round to
    # 0 against float32 masses and keep nothing; the first id's mass before it is 0 < top_p, and
    # the clamp holds that whatever the rounding (a prefix: the first is always kept)
    kept = (before.double() < top_p).sum(dim=-1, keepdim=True).clamp_min(1)
    return values.gather(-1, kept - 1), kept


def _floor_among_candidates(logits: torch.Tensor, total: torch.Tensor, top_p: float) -> torch.Tensor:
    """_floor over each row's TOP_P_CANDIDATES most likely logits (topk), again over more of
    them for the rows whose set may reach past those, and over a sort of the rest at last."""
    vocab = logits.shape[-1]
    floor, rows = None, None  # each row's floor as found so far; the rows still looking (None: all)
    for k in (*(c for c in TOP_P_CANDIDATES if c < vocab), vocab):
        part = logits if rows is None else logits[rows]
        values = torch.topk(part, k, dim=-1).values if k < vocab else torch.sort(part, dim=-1, descending=True).values
        found, kept = _floor(values, total if rows is None else total[rows], top_p)
        floor = found if rows is None else floor.index_put_((rows,), found)
        beyond = kept[:, 0] == k  # the set may go on past these candidates
        if k == vocab or not bool(beyond.any()):
            return floor
        rows = beyond.nonzero()[:, 0] if rows is None else rows[beyond]
    raise AssertionError("unreachable: the last search is over the whole vocabulary")


def greedy_top_on_host(logits: torch.Tensor, k: int) -> list[tuple[list[int], list[float], float]]:
    """Greedy (temperature 0) rows of logits [n, vocab] on a host device, read as Python values:
    each row's k most likely ids under q = softmax(logits) (most likely first, the lowest id
    first among ties, as argmax chooses), their q, and the entropy of q in nats. On a CPU, torch's
    argmax and topk over a draft step's rows cost ~10 µs a row each and entropy's log another ~10,
    where numpy's argmax costs ~0.3: a draft step of 11 rows chose in 548 µs, now 360-420
    (docs/benchmarks.md). The entropy is logsumexp - sum(q * logits), logsumexp read off the top
    id (its logit less log q); a column at -inf is read at float32's lowest (its q is 0 either
    way), so it adds nothing; rounding of a near-certain row is clamped at 0."""
    x = torch.clamp_min(logits.float(), FLOAT32_LOWEST)  # a copy: the caller's rows stay as they are
    probs, values = torch.softmax(x, dim=-1).numpy(), x.numpy()
    n, rows = x.shape[0], np.arange(x.shape[0])
    weighted = (probs[:, None, :] @ values[:, :, None])[:, 0, 0]  # sum(q * logits), a row at a time
    ids, top_q = np.empty((n, k), dtype=np.int64), np.empty((n, k), dtype=np.float64)
    for j in range(k):  # k argmaxes, each taking its id out of q (ours): ties keep their lowest id first
        ids[:, j] = probs.argmax(axis=1)
        top_q[:, j] = probs[rows, ids[:, j]]
        probs[rows, ids[:, j]] = -1.0
    h = np.maximum(values[rows, ids[:, 0]] - np.log(top_q[:, 0]) - weighted, 0.0)  # float64, as top_q
    return list(zip(ids.tolist(), top_q.tolist(), h.tolist()))


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
    the right edge of a stretch of zeros steps back to the last id before it with mass.

    The first id whose cumulative mass passes the target always has mass (adding a zero leaves
    a float64 sum where it was), so the step back is only ever needed past the last id: there the
    draw is the row's last id with mass (one reduction, not a running maximum over the row)."""
    cdf = probs.double().cumsum(dim=-1)  # [n, vocab]
    target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]  # [n, 1]
    index = torch.searchsorted(cdf, target, right=True)[:, 0]  # [n]; vocab: past the last id
    ids = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, ids, 0).amax(dim=-1)  # [n] the last id with mass (0 if none)
    return torch.where(index < probs.shape[-1], index, last)
