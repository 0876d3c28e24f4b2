"""The feature draft: blocks drafted by a feature head (feature_head.py) from the target's own
hidden states, through the same ``BlockDraft`` and length policies as the token draft.

The head's pair at position j is (g_j, e(x_{j+1})): the target's fused feature at j beside the
embedding of the token after it; its output there predicts x_{j+2}. So after a verdict that leaves
``committed`` (length L) and hands over the target's features up to position L - 2 (the verdict's
own token at L - 1 has none yet), the block's first forward takes in the pairs not yet cached, up to
(g_{L-2}, e(x_{L-1})), and its last output row gives the first drafted token. Each further token is
drafted from the pair (the head's own last output, e(the token just drafted)): the head feeds back
its own state where the target's feature is not known. The head's cache keeps the pairs built from
the target's features (they never change: they are at committed positions) and drops the ones built
from its own when the next block begins.

A session has nothing to draft from until the target has run over its prompt: its first block is
empty (that round is the target alone, and its verdict brings the prompt's features). The head's
forward is one decoder layer per session, run beside the others' in ``FeatureDrafter.step``; the
tokens are chosen for all of them in one batched pass and one host read, as the token draft's are.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from draft_worker.drafter import PREFILL_TOKENS, BlockDraft, Drafter, DraftSession
from draft_worker.feature_head import FeatureHead, HeadCache, load_head
from draft_worker.policies import make_policy
from svip_common.contracts import PolicyConfig, SamplingParams, Verdict
from svip_common.kv_cache import wait_for_device
from svip_common.models import LoadedModel

HEAD_ARCHITECTURE = "Eagle"  # in config.json's architectures: a directory holding a feature head


@dataclass
class LoadedHead:
    """A feature head loaded for a target."""

    path: str
    head: FeatureHead


def is_feature_head(path: str | None) -> bool:
    """Whether a draft directory holds a feature head (its config.json names an EAGLE architecture)."""
    if path is None:
        return False
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    architectures = raw.get("architectures") if isinstance(raw, dict) else None
    return isinstance(architectures, list) and any(HEAD_ARCHITECTURE in str(a) for a in architectures)


def load_feature_draft(path: str, target: LoadedModel) -> LoadedHead:
    """The head at ``path`` in the target's dtype and on its device, checked against it (one-line
    ModelLoadError otherwise)."""
    model = target.model
    return LoadedHead(path, load_head(path, model.config.get_text_config(decoder=True), model.dtype, model.device))


class FeatureDrafter(Drafter):
    """A feature head beside the target's embedding table, shared by the sessions it opens."""

    def __init__(self, head: LoadedHead, embedding: torch.nn.Embedding, target_vocab_size: int, token_limit: int):
        self.draft = head  # .path: where the head came from
        self.head = head.head
        self.embedding = embedding  # the target's: the head has none of its own
        self.width = target_vocab_size
        self.token_limit = token_limit
        self.max_batched_tokens = None  # a block's first forward is one layer over its new pairs
        self.pool = None  # no KV pool: each session's head cache grows as it drafts
        c = self.head.config
        self._columns = self.head.target_ids(torch.arange(c.draft_vocab_size, device=self.head.d2t.device))

    @torch.inference_mode()
    def step(self, drafts: Sequence[BlockDraft]) -> None:
        """Advance every unfinished block by one token: the head's layer per session, then the
        LM head and the choice for all of them at once."""
        live = [d for d in drafts if not d.done]
        if not live:
            return
        started = time.perf_counter()
        hidden = []
        for d in live:
            d._prefilling = _pairs(d._pending) > PREFILL_TOKENS
            hidden.append(d._session._advance(d._pending))
        rows = self.head.logits(torch.cat(hidden))  # [B, draft_vocab]
        wait_for_device(rows.device)
        self._absorb_rows(live, list(rows.split(1)), (time.perf_counter() - started) / len(live))

    def _widen(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's logits over its own vocabulary, placed at the target ids d2t maps them to."""
        full = logits.new_full((logits.shape[0], self.width), float("-inf"))
        return full.index_copy_(1, self._columns, logits)

    def open(self, sampling: SamplingParams, policy: PolicyConfig, stop_token_ids: Sequence[int]
             ) -> FeatureDraftSession:
        return FeatureDraftSession(self, sampling, make_policy(policy), stop_token_ids)


class FeatureDraftSession(DraftSession):
    """One request's head cache and the target features it has not yet taken in."""

    def __init__(self, drafter: FeatureDrafter, sampling: SamplingParams, policy, stop_token_ids: Sequence[int]):
        self.sampling = sampling
        self.policy = policy
        self.stop_token_ids = frozenset(stop_token_ids)
        self._drafter = drafter
        self._cache = HeadCache()
        self._tokens: list[int] = []  # committed tokens x_0 .. x_t whose pairs at 0 .. t-1 the cache holds
        self._stash: torch.Tensor | None = None  # the target's features [n, layers x h] at positions _stash_from..
        self._stash_from = 0
        self._own: torch.Tensor | None = None  # the head's last output row [1, h]: the next pair's feature
        self.forwards = 0
        self.forward_s = 0.0
        self.prefill_s = 0.0
        self.compute_s = 0.0

    @property
    def cached_tokens(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._cache, self._stash, self._own, self._tokens = HeadCache(), None, None, []

    def take_features(self, verdict: Verdict) -> None:
        """Keep the target's features a verdict hands over (positions features_from..); ones
        handed again from an earlier position (the target recomputed them) replace what was kept
        from there."""
        features, first = verdict.features, verdict.features_from
        if features is None or features.shape[0] == 0:
            return
        if self._stash is not None and self._stash_from <= first <= self._stash_from + self._stash.shape[0]:
            features = torch.cat([self._stash[: first - self._stash_from], features])
            first = self._stash_from
        self._stash, self._stash_from = features, first

    def _resume(self, committed: Sequence[int]):
        """The block's first forward: the pairs (target features, next tokens) at the positions the
        cache lacks, up to L - 2 for ``committed`` of length L; None when the target's features do
        not reach that far yet (the first round: the block stays empty)."""
        end = len(committed) - 1  # pairs at positions keep .. end - 1
        keep = min(len(self._tokens) - 1, end - 1)  # cached target pairs that stay (one re-fed at least)
        if keep > 0 and self._tokens[: keep + 1] != list(committed[: keep + 1]):
            keep = _common_prefix(self._tokens, committed) - 1
        keep = max(keep, 0)
        if end < 1 or self._stash is None:
            return None
        have = self._stash_from + self._stash.shape[0]
        if self._stash_from > keep or have < end:
            return None  # the features for these positions are not here (yet)
        raw = self._stash[keep - self._stash_from : end - self._stash_from]
        return _Pairs(keep, raw, list(committed[keep + 1 : end + 1]), list(committed[: end + 1]))

    def _advance(self, pending) -> torch.Tensor:
        """The head's forward for a block's next token: its last output row [1, h]."""
        drafter = self._drafter
        if isinstance(pending, _Pairs):
            self._cache.rollback(pending.first)
            features, ids = drafter.head.fc(pending.raw), pending.ids
            self._tokens = pending.tokens
            self._trim(pending.first + len(ids) - 1)
        else:  # the token just drafted, beside the head's own last output
            features, ids = self._own, pending
        embeds = drafter.embedding(torch.tensor(ids, dtype=torch.long, device=features.device))
        self._own = drafter.head(embeds, features, self._cache)[-1:]
        return self._own

    def _trim(self, first: int) -> None:
        """Drop kept features before position ``first`` (the last taken in stays, to be re-fed)."""
        if self._stash is not None and first > self._stash_from:
            self._stash = self._stash[first - self._stash_from :]
            self._stash_from = first


@dataclass
class _Pairs:
    """A block's first forward: pairs at positions first .. first + len(ids) - 1."""

    first: int
    raw: torch.Tensor  # the target's features there [n, layers x h]
    ids: list[int]  # the tokens after each: x_{first+1} ..
    tokens: list[int]  # committed up to the last of them


def _pairs(pending) -> int:
    return len(pending.ids) if isinstance(pending, _Pairs) else len(pending)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
