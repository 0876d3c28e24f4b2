"""Rejection sampling for speculative decoding, as pure functions: no models, no I/O.

Words:
- *accepted* tokens: the drafted prefix the target keeps. Greedy: d_i is kept while it equals
  argmax p_i. Sampling: d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)).
- *recovered* token (correction): after the first rejection at position j, drawn from
  norm(max(0, p_j - q_j)); with the accepted prefix it makes the output follow p exactly
  (Leviathan et al., 2023; Chen et al., 2023).
- *bonus* token: after a fully accepted block of k, position k+1 is drawn from p_{k+1}.
Each output position is settled once: by accepting / rejecting a drafted token, or by a draw from p.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from svip_common.sampling import sample_index


def accept_greedy(target_argmax: Sequence[int], draft: Sequence[int]) -> int:
    """Length of the drafted prefix that matches the target's argmax tokens."""
    for i, token in enumerate(draft):
        if token != target_argmax[i]:
            return i
    return len(draft)


def accept_sampled(
    p_draft: Sequence[float], q_draft: Sequence[float], uniforms: Sequence[float]
) -> int:
    """Length of the accepted prefix: d_i is accepted iff u_i * q(d_i) < p(d_i), i.e. with
    probability min(1, p(d_i)/q(d_i)) for u_i uniform in [0, 1)."""
    for i, (p, q, u) in enumerate(zip(p_draft, q_draft, uniforms)):
        if not u * q < p:
            return i
    return len(p_draft)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) over the vocabulary (the last axis: [vocab] or rows [n, vocab]), unnormalised,
    with no host read. A row where p == q up to rounding (so no rejection was possible in exact
    arithmetic) falls back to p."""
    r = (p - q).clamp_min(0.0)
    return torch.where(r.sum(dim=-1, keepdim=True) > 1e-12, r, p)


def recover(p: torch.Tensor, q: torch.Tensor, u: float) -> int:
    """The correction after a rejection: a draw from norm(max(0, p - q))."""
    return sample_index(residual(p, q), u)


def branch_sampled(r: torch.Tensor, siblings: list[int], u: list[float]) -> tuple[int | None, torch.Tensor]:
    """A token tree's sampled rejection at a place whose drafted token was rejected: the residual
    r = max(0, p - q) [vocab] (unnormalised), and the siblings drafted there, tried in order. Each
    is taken with its probability under what is left of r (uniform u[j]); one not taken leaves r
    without it, renormalised. Returns the sibling taken (None: none), and what is left of r, from
    which the correction is drawn when none was. Exact for any fixed list of candidates: a sibling
    s is the outcome with probability r(s), any other token with r(x), so the place follows r
    as the chain's correction does (SpecInfer's multi-candidate rejection, each candidate a point
    mass; the siblings depend only on q and the rejected token, so the residual is followed
    whatever they are). Reads r at each sibling to the host."""
    left = r / r.sum()
    for s, coin in zip(siblings, u):
        mass = float(left[s])
        if coin < mass:
            return s, left
        left = left.clone()
        left[s] = 0.0
        total = float(left.sum())
        if total <= 0.0:  # the sibling held all of it (its coin fell on rounding's edge): the only outcome
            return s, left
        left = left / total
    return None, left
