"""The cache adapter: the only module that touches transformers' cache API.

transformers 5.24 renamed the forward argument ``past_key_values=`` to ``cache=`` and made
``DynamicCache.crop`` take a negative count of tokens to drop; a release that moves it again
changes this file alone (tests/unit/test_kv_cache.py pins the behaviour).

A ``KVCache`` remembers which tokens its keys and values belong to, so rolling back is one call:
``rollback_to_prefix_of(sequence)`` keeps the longest cached prefix that ``sequence`` shares.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel


class KVCache:
    def __init__(self, model: PreTrainedModel):
        self._model = model
        self._cache = DynamicCache(config=model.config)
        self._tokens: list[int] = []

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        """The tokens whose keys and values are cached (a copy)."""
        return list(self._tokens)

    def forward(self, token_ids: Sequence[int], logits_to_keep: int = 1) -> torch.Tensor:
        """Run the model on token_ids after the cached ones; returns the last logits_to_keep rows
        of logits, [logits_to_keep, vocab]."""
        device = self._model.device
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)  # [1, n]
        out = self._model(
            input_ids=input_ids, cache=self._cache, use_cache=True, logits_to_keep=logits_to_keep
        )
        self._tokens.extend(token_ids)
        return out.logits[0, -logits_to_keep:]  # [logits_to_keep, vocab]

    def tokens_equal(self, sequence: Sequence[int]) -> bool:
        """The cache holds exactly ``sequence``."""
        return len(self._tokens) == len(sequence) and self._tokens == list(sequence)

    def rollback(self, length: int) -> None:
        """Drop every cached token past the first ``length``."""
        drop = len(self._tokens) - length
        if drop > 0:
            self._cache.crop(-drop)
            del self._tokens[length:]

    def rollback_to_prefix_of(self, sequence: Sequence[int], limit: int | None = None) -> int:
        """Keep the longest cached prefix shared with ``sequence`` (at most ``limit`` tokens);
        returns the number of tokens kept."""
        keep = min(len(self._tokens), len(sequence) if limit is None else limit)
        if self._tokens[:keep] != list(sequence[:keep]):
            keep = next(i for i, (a, b) in enumerate(zip(self._tokens, sequence)) if a != b)
        self.rollback(keep)
        return keep
