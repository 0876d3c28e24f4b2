"""The verifier: hosts the target model and answers each block with a verdict in one forward.

A ``TargetSession`` owns one request's target KV cache. ``verify`` rolls the cache back to what
the committed sequence still shares, runs the uncached committed tokens plus the block through
the target in one pass, and settles the next positions with the rejection rule.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from svip_common.contracts import Block, SamplingParams, Verdict
from svip_common.kv_cache import KVCache
from svip_common.models import LoadedModel
from svip_common.randomness import Purpose, uniform
from svip_common.sampling import sample_index, warp_probs
from target_worker.rejection import accept_greedy, accept_sampled, recover


class Verifier:
    """The target model, shared by the sessions it opens."""

    def __init__(self, target: LoadedModel):
        self.target = target

    def open(self, sampling: SamplingParams) -> TargetSession:
        return TargetSession(self, sampling)


class TargetSession:
    def __init__(self, verifier: Verifier, sampling: SamplingParams):
        self.sampling = sampling
        self._cache = KVCache(verifier.target.model)
        self.forwards = 0
        self.forward_s = 0.0

    @property
    def cached_tokens(self) -> int:
        return len(self._cache)

    @torch.inference_mode()
    def verify(self, committed: Sequence[int], block: Block) -> Verdict:
        base, k = len(committed), len(block)
        logits = self._score(committed, block.tokens)  # [k + 1, vocab]
        if self.sampling.greedy:
            target_tokens = torch.argmax(logits, dim=-1).tolist()  # [k + 1]
            accepted = accept_greedy(target_tokens, block.tokens)
            return Verdict(base=base, accepted=accepted, token=target_tokens[accepted])
        p = warp_probs(logits, self.sampling)  # [k + 1, vocab]
        seed = self.sampling.seed
        if k:
            p_draft = p[torch.arange(k), torch.tensor(block.tokens)].tolist()  # [k]
            uniforms = [uniform(seed, base + i, Purpose.ACCEPT) for i in range(k)]
            accepted = accept_sampled(p_draft, block.probs, uniforms)
        else:
            accepted = 0
        u = uniform(seed, base + accepted, Purpose.RESOLVE)
        if accepted < k:
            token = recover(p[accepted], block.q_rows[accepted], u)
        else:
            token = sample_index(p[k], u)
        return Verdict(base=base, accepted=accepted, token=token)

    def _score(self, committed: Sequence[int], drafted: list[int]) -> torch.Tensor:
        kept = self._cache.rollback_to_prefix_of(committed, limit=len(committed) - 1)
        start = time.perf_counter()
        logits = self._cache.forward([*committed[kept:], *drafted], logits_to_keep=len(drafted) + 1)
        self.forward_s += time.perf_counter() - start
        self.forwards += 1
        return logits
