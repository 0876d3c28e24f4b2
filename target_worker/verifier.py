"""The verifier: hosts the target model and answers each block with a verdict in one forward.

A ``TargetSession`` owns one request's target KV cache. ``verify`` rolls the cache back to what
the committed sequence still shares, runs the uncached committed tokens plus the block through
the target in one pass, and settles the next positions with the rejection rule.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from svip_common.contracts import NO_TOKEN, Block, SamplingParams, Verdict
from svip_common.kv_cache import KVCache
from svip_common.models import LoadedModel
from svip_common.randomness import Purpose, uniform
from svip_common.sampling import mask_padding, sample_index, warp_probs
from target_worker.rejection import accept_greedy, accept_sampled, recover


class Verifier:
    """The target model, shared by the sessions it opens."""

    def __init__(self, target: LoadedModel, token_limit: int | None = None):
        self.target = target
        self.token_limit = target.token_limit if token_limit is None else token_limit  # ids it may emit
        self.tokens_verified = 0  # drafted tokens, every session

    def open(self, sampling: SamplingParams) -> TargetSession:
        return TargetSession(self, sampling)


class TargetSession:
    def __init__(self, verifier: Verifier, sampling: SamplingParams):
        self.sampling = sampling
        self._cache = KVCache(verifier.target.model)
        self._verifier = verifier
        self._limit = verifier.token_limit
        self._pending: torch.Tensor | None = None  # [1, vocab]: logits for position _pending_at
        self._pending_at = -1
        self.forwards = 0
        self.forward_s = 0.0

    @property
    def cached_tokens(self) -> int:
        return len(self._cache)

    @torch.inference_mode()
    def verify(self, committed: Sequence[int], block: Block) -> Verdict:
        """Settle the block. When the block's q rows live on the draft side (distributed
        sampling), a rejection returns ``token = -1`` and ``p_row``, and the draft side draws the
        correction from norm(max(0, p_row - q))."""
        base, k = len(committed), len(block)
        early = self.judge_first(committed, block)
        if early is not None:
            return early
        self._verifier.tokens_verified += k
        logits = self._score(committed, block.tokens)  # [k + 1, vocab]
        if self.sampling.greedy:
            target_tokens = torch.argmax(logits, dim=-1).tolist()  # [k + 1]
            accepted = accept_greedy(target_tokens, block.tokens)
            return Verdict(base=base, accepted=accepted, token=target_tokens[accepted], epoch=block.epoch)
        p = warp_probs(logits, self.sampling)  # [k + 1, vocab]
        seed = self.sampling.seed
        if k:
            p_draft = p[torch.arange(k), torch.tensor(block.tokens)].tolist()  # [k]
            uniforms = [uniform(seed, base + i, Purpose.ACCEPT) for i in range(k)]
            accepted = accept_sampled(p_draft, block.probs, uniforms)
        else:
            accepted = 0
        u = uniform(seed, base + accepted, Purpose.RESOLVE)
        if accepted == k:
            token = sample_index(p[k], u)
        elif block.q_rows is None:
            return Verdict(base=base, accepted=accepted, token=NO_TOKEN, epoch=block.epoch, p_row=p[accepted])
        else:
            token = recover(p[accepted], block.q_rows[accepted], u)
        return Verdict(base=base, accepted=accepted, token=token, epoch=block.epoch)

    def _holds(self, committed: Sequence[int]) -> bool:
        """The cache holds exactly ``committed`` and the row for the next place is stored (the
        block continues a fully accepted one)."""
        return self._pending is not None and self._pending_at == len(committed) == len(self._cache) and \
            self._cache.tokens_equal(committed)

    @torch.inference_mode()
    def judge_first(self, committed: Sequence[int], block: Block) -> Verdict | None:
        """A block that continues a fully accepted one: its first token judged against the row
        already stored for that place, before any forward, by the same rule and the same keyed
        coin as the full pass. A rejection is the verdict at once (no forward for the tokens
        after it, which would all be discarded); None: verify() runs the forward."""
        if not block.tokens or not self._holds(committed):
            return None
        base, d0 = len(committed), block.tokens[0]
        if self.sampling.greedy:
            target = int(torch.argmax(self._pending[0]))
            if target == d0:
                return None
            self._verifier.tokens_verified += len(block)
            return Verdict(base=base, accepted=0, token=target, epoch=block.epoch)
        p0 = warp_probs(self._pending, self.sampling)[0]  # [vocab]
        if accept_sampled([float(p0[d0])], block.probs[:1], [uniform(self.sampling.seed, base, Purpose.ACCEPT)]):
            return None
        self._verifier.tokens_verified += len(block)
        if block.q_rows is None:
            return Verdict(base=base, accepted=0, token=NO_TOKEN, epoch=block.epoch, p_row=p0)
        token = recover(p0, block.q_rows[0], uniform(self.sampling.seed, base, Purpose.RESOLVE))
        return Verdict(base=base, accepted=0, token=token, epoch=block.epoch)

    def _score(self, committed: Sequence[int], drafted: list[int]) -> torch.Tensor:
        """Target logits for positions len(committed) .. len(committed) + len(drafted).

        The row for the first of them is reused from the previous forward when the cache holds
        exactly ``committed`` (a pre-drafted block continuing a fully accepted one)."""
        base = len(committed)
        kept = self._cache.rollback_to_prefix_of(committed)
        reuse = kept == base and self._pending_at == base and self._pending is not None
        if not reuse and kept == base:
            self._cache.rollback(base - 1)
            kept = base - 1
        start = time.perf_counter()
        if reuse and not drafted:
            logits = self._pending
        elif reuse:
            tail = self._cache.forward(drafted, logits_to_keep=len(drafted))  # [k, vocab]
            logits = torch.cat([self._pending, tail])
        else:
            logits = self._cache.forward([*committed[kept:], *drafted], logits_to_keep=len(drafted) + 1)
        logits = mask_padding(logits, self._limit)
        if not (reuse and not drafted):
            self.forwards += 1
        self.forward_s += time.perf_counter() - start
        self._pending, self._pending_at = logits[-1:], len(self._cache)
        return logits
