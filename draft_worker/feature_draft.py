"""The feature draft: blocks drafted by a feature head (feature_head.py) from the target's own
hidden states, through the same ``BlockDraft`` and length policies as the token draft.

The head's pair at position j is (g_j, e(x_{j+1})): the target's fused feature at j beside the
embedding of the token after it; its output there predicts x_{j+2}. So after a verdict that leaves
``committed`` (length L) and hands over the target's features up to position L - 2 (the verdict's
own token at L - 1 has none yet), the block's first forward takes in the pairs not yet cached, up to
(g_{L-2}, e(x_{L-1})), and its last output row gives the first drafted token. Each further token is
drafted from the pair (the head's own last output, e(the token just drafted)): the head feeds back
its own state where the target's feature is not known. The head's cache keeps the pairs built from
the target's features (they never change: they are at committed positions); pairs built on its own
outputs stay while the target's features for them have not arrived (the distributed pipeline drafts
ahead of its verdicts) and are replaced by the target's once they have.

A session has nothing to draft from until the target has run over its prompt: its first block is
empty (that round is the target alone, and its verdict brings the prompt's features). The head's
forward is one decoder layer per session, run beside the others' in ``FeatureDrafter.step``; the
tokens are chosen for all of them in one batched pass and one host read, as the token draft's are.
"""

from __future__ import annotations

import json
import time
import weakref
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from draft_worker.drafter import PREFILL_TOKENS, BlockDraft, Drafter, DraftSession
from draft_worker.feature_head import FeatureHead, HeadCache, HeadConfig, load_head
from draft_worker.policies import make_policy
from svip_common.contracts import PolicyConfig, SamplingParams
from svip_common.errors import ModelLoadError
from svip_common.grammar_mask import GrammarMask
from svip_common.hub import split_revision
from svip_common.kv_cache import wait_for_device
from svip_common.kv_sizes import DEFAULT_KV_TOKENS
from svip_common.models import LoadedModel
from svip_common.row_rules import RowRules
from svip_common.sequences import common_prefix


@dataclass
class LoadedHead:
    """A feature head loaded for a target; in the draft worker, with the target's embedding table
    beside it (in process the drafter reads the target model's own)."""

    path: str
    head: FeatureHead
    embedding: torch.nn.Embedding | None = None
    tokenizer: object | None = None  # the target's: structured output's masks (None: the head drafts unmasked)

    @property
    def model(self) -> torch.nn.Module:
        return self.head


def head_layers(path: str, target_layer_count: int | None = None) -> tuple[int, ...]:
    """The target layers a head directory's config fuses (what the target worker hands over);
    EAGLE-3's default for the target's depth where the config names none."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read config.json ({exc})") from None
    return HeadConfig.from_dict(raw, path, target_layer_count).target_layers


def load_feature_draft(path: str, target: LoadedModel) -> LoadedHead:
    """The head at ``path`` in the target's dtype and on its device, checked against it (one-line
    ModelLoadError otherwise)."""
    model = target.model
    head = load_head(path, model.config.get_text_config(decoder=True), model.dtype, model.device)
    return LoadedHead(path, head, tokenizer=target.tokenizer)


def load_head_beside(path: str, target_path: str, dtype: str = "float32", device: str = "cpu") -> LoadedHead:
    """A head for a target that lives in another process: the target's config and its embedding
    table only (read from its safetensors, not the whole model), the head checked against them."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from svip_common.models import DTYPES

    torch_dtype = DTYPES.get(dtype)
    if torch_dtype is None or torch_dtype == "auto":
        raise ModelLoadError(f"a feature head needs an explicit dtype, got {dtype!r}")
    try:
        repo, revision = split_revision(target_path)  # owner/name@revision: pinned
        config = AutoConfig.from_pretrained(repo, revision=revision).get_text_config(decoder=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the target's config at {target_path!r}: {exc}") from None
    name, file = _embedding_file(target_path)
    with safe_open(str(file), framework="pt", device="cpu") as f:
        table = f.get_tensor(name)
    if tuple(table.shape) != (config.vocab_size, config.hidden_size):
        raise ModelLoadError(f"{target_path}: {name} has shape {list(table.shape)}, the config says "
                             f"[{config.vocab_size}, {config.hidden_size}]")
    embedding = torch.nn.Embedding.from_pretrained(table.to(torch_dtype), freeze=True).to(device)
    return LoadedHead(path, load_head(path, config, torch_dtype, device), embedding, _tokenizer_of(repo, revision))


def _tokenizer_of(repo: str, revision: str | None):
    """The target's tokenizer, for structured output's masks on the head's rows (None where the
    checkpoint has none: the head then drafts unmasked, and the target's mask keeps the output exact)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(repo, revision=revision)
    except (OSError, ValueError, KeyError):
        return None


def _embedding_file(target: str) -> tuple[str, Path]:
    """The target checkpoint's input embedding: its tensor name and the safetensors file holding it
    (for a hub id, only the index and that one file are fetched)."""
    from svip_common.hub import local_file

    index = local_file(target, "model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    elif (single := local_file(target, "model.safetensors")) is not None:
        from safetensors import safe_open

        with safe_open(str(single), framework="pt", device="cpu") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        raise ModelLoadError(f"{target}: no safetensors checkpoint to read the target's embedding from")
    names = sorted(k for k in weight_map if k.endswith("embed_tokens.weight"))
    if not names:
        raise ModelLoadError(f"{target}: the checkpoint has no embed_tokens.weight")
    file = local_file(target, weight_map[names[0]])
    if file is None:
        raise ModelLoadError(f"{target}: {weight_map[names[0]]} (named by the index for {names[0]}) is missing")
    return names[0], file


class FeatureDrafter(Drafter):
    """A feature head beside the target's embedding table, shared by the sessions it opens."""

    grows = True  # trees deep and deep-auto: the last place's siblings get a child each (one head forward for all)

    def __init__(self, head: LoadedHead, embedding: torch.nn.Embedding, target_vocab_size: int, token_limit: int,
                 kv_cache_tokens: int = DEFAULT_KV_TOKENS):
        """kv_cache_tokens: what the head caches are reported against (they grow with their sessions)."""
        self.draft = head  # .path: where the head came from
        self.head = head.head
        self.embedding = embedding  # the target's: the head has none of its own
        self.width = target_vocab_size
        self.token_limit = token_limit
        self.pool = None  # no KV pool: each session's head cache grows as it drafts
        self.timing = None  # device timing (svip_common/device_timing.py): a step lasts the head's step model
        self.kv_cache_tokens = kv_cache_tokens
        self.fresh_starts = 0  # sessions that lost the target's features for some positions and started afresh
        self._sessions: weakref.WeakSet[FeatureDraftSession] = weakref.WeakSet()
        c = self.head.config
        self._columns = self.head.target_ids(torch.arange(c.draft_vocab_size, device=self.head.d2t.device))

    @torch.inference_mode()
    def step(self, drafts: Sequence[BlockDraft]) -> None:
        """Advance every unfinished block by one token: the head's layer once for every session
        that feeds the token it just drafted (each attends its own cache), a block's first forward
        (its pairs) per session; then the LM head and the choice for all of them at once. A deep
        tree whose spine is done grows its last place's siblings instead (``_grown_rows``)."""
        live = [d for d in drafts if not d.done]
        if not live:
            return
        growing = [d for d in live if d._spine_done]  # spines done, blocks not: the last place's siblings to grow
        drafting = [d for d in live if not d._spine_done]
        shapes = [(len(d._riders), len(d._session._cache)) for d in growing]
        shapes += [(len(d._pending), len(d._session._cache)) for d in drafting]
        started = time.perf_counter()
        with nullcontext() if self.timing is None else self.timing.forward(shapes):
            grown = [self._grown_rows(d) for d in growing]
            rows = self._forward(drafting) if drafting else []
        elapsed = time.perf_counter() - started
        if self.timing is not None and self.timing.virtual:  # a virtual device's time, as a pool's forward reports it
            elapsed = self.timing.last_s
        share = elapsed / len(live)
        for d, logits in zip(growing, grown):
            self._grow(d, logits, share)
        self._absorb_rows(drafting, rows, share)

    def _grown_rows(self, d: BlockDraft) -> torch.Tensor:
        """A deep tree's last place: its siblings, each beside the head's output before that place
        (what the spine's token there is fed with), in one forward where none attends another;
        their rows of logits [siblings, draft_vocab]. The siblings of earlier places stay leaves:
        their rows would cost forwards of their own too."""
        session = d._session
        feature = session._last_output()
        ids = torch.tensor([token for _, token in d._riders], dtype=torch.long, device=feature.device)
        hidden = self.head.beside(self.embedding(ids), feature.expand(len(ids), -1), session._cache)
        return self.head.logits(hidden)

    def _forward(self, live: list[BlockDraft]) -> list[torch.Tensor]:
        """The step's forward: each block's row of the head's logits [1, draft_vocab]."""
        hidden: list[torch.Tensor | None] = [None] * len(live)
        for d in live:
            d._prefilling = len(d._pending) > PREFILL_TOKENS
        together = [i for i, d in enumerate(live) if not isinstance(d._pending, _Pairs)]  # a drafted token each
        if len(together) > 1:
            rows = self._advance_tokens([live[i]._session for i in together], [live[i]._pending[0] for i in together])
            for i, row in zip(together, rows.split(1)):
                hidden[i] = row
        for i, d in enumerate(live):  # blocks' first forwards (their pairs), and a lone drafted token
            if hidden[i] is None:
                hidden[i] = d._session._advance(d._pending)
        rows = self.head.logits(torch.cat(hidden))  # [B, draft_vocab]
        wait_for_device(rows.device)
        return list(rows.split(1))

    def _advance_tokens(self, sessions: list[FeatureDraftSession], tokens: list[int]) -> torch.Tensor:
        """Each session's token just drafted, beside its head's last output, through the head's
        layer together: their outputs [B, h] (each kept by its session as ``_advance`` keeps it)."""
        features = torch.cat([s._last_output() for s in sessions])
        embeds = self.embedding(torch.tensor(tokens, dtype=torch.long, device=features.device))
        starts = [len(s._cache) for s in sessions]
        outputs = self.head.decode_rows(embeds, features, [s._cache for s in sessions])
        for session, start, token, row in zip(sessions, starts, tokens, outputs.split(1)):
            session._keep_outputs(start, row)
            session._fed.append(token)
        return outputs

    def _widen(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's logits over its own vocabulary, placed at the target ids d2t maps them to."""
        full = logits.new_full((logits.shape[0], self.width), float("-inf"))
        return full.index_copy_(1, self._columns, logits)

    def open(self, sampling: SamplingParams, policy: PolicyConfig, stop_token_ids: Sequence[int],
             prompt_len: int = 0, cache_scope: str = "") -> FeatureDraftSession:
        """prompt_len: where the generated tokens start, for the grammar's mask (the head drafts
        without the request's penalties; the target applies them); cache_scope: unread, a head's
        sessions share no pages (each holds its own features)."""
        session = FeatureDraftSession(self, sampling, make_policy(policy), stop_token_ids, policy.tree, prompt_len)
        self._sessions.add(session)
        return session

    def cache_use(self) -> CacheUse:
        return CacheUse(self.kv_cache_tokens, sum(len(s._cache) for s in list(self._sessions)))


class FeatureDraftSession(DraftSession):
    """One request's head cache, the pairs it holds, and the target features not yet taken in.

    Cache position j holds the pair (feature at j, e(x_{j+1})) and its output a_{j+1}, the head's
    stand-in for the target's feature at j + 1 (j counted from ``_offset``: 0 unless the head had to
    start afresh). The first ``_true`` positions were fed the
    target's own features; the rest, the head's outputs (its drafted tokens, and in the
    distributed pipeline blocks drafted ahead of their verdicts). A block's first forward keeps
    the cached pairs whose tokens the committed sequence still has, but re-feeds the target's
    features where they have arrived in place of the head's own, and builds the missing pairs
    from the target's features where known, else from the head's kept outputs."""

    can_fork = False  # a head cache does not fork: its blocks are drafted one at a time

    def __init__(self, drafter: FeatureDrafter, sampling: SamplingParams, policy, stop_token_ids: Sequence[int],
                 tree: str = "off", prompt_len: int = 0):
        """tree: each block a token tree (svip_common/trees.py): its siblings are the head's
        runners-up at each drafted place; deep trees feed the last place's to the head for a
        child each (FeatureDrafter._grown_rows)."""
        self.sampling = sampling
        self.tree = tree
        grammar = None  # the head drafts under the request's grammar where it has the target's tokenizer
        if sampling.grammar is not None and drafter.draft.tokenizer is not None:
            grammar = GrammarMask(sampling.grammar, drafter.grammar_tokenizer())
        self.rules = RowRules(prompt_len, sampling.logit_bias, grammar=grammar)  # its bias; penalties: the target's
        self.policy = policy
        self.stop_token_ids = frozenset(stop_token_ids)
        self._drafter = drafter
        self._cache = HeadCache()
        self._fed: list[int] = []  # per cache position j: the token x_{j+1} of its pair
        self._outputs: torch.Tensor | None = None  # [capacity, h]: the output at each cache position
        self._true = 0  # leading cache positions fed the target's features
        self._offset = 0  # the sequence position of cache position 0 (> 0 after a fresh start)
        self._stash: torch.Tensor | None = None  # the target's features [n, layers x h] at positions _stash_from..
        self._stash_from = 0
        self.forwards = 0
        self.forward_s = 0.0
        self.prefill_s = 0.0
        self.compute_s = 0.0

    @property
    def cached_tokens(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._cache, self._fed, self._outputs, self._true, self._stash = HeadCache(), [], None, 0, None
        self._offset = 0

    def take_features(self, features: torch.Tensor | None, first: int) -> None:
        """Keep the target's features at positions first.. (a verdict's); ones handed again from an
        earlier position (the target recomputed them) replace what was kept from there."""
        if features is None or features.shape[0] == 0:
            return
        if self._stash is not None and self._stash_from <= first <= self._stash_from + self._stash.shape[0]:
            features = torch.cat([self._stash[: first - self._stash_from], features])
            first = self._stash_from
        self._stash, self._stash_from = features, first

    @property
    def _known(self) -> int:
        """Positions .. _known - 1 have the target's features (kept, or already fed)."""
        return self._stash_from + self._stash.shape[0] if self._stash is not None else self._offset + self._true

    def _resume(self, committed: Sequence[int], cache=None):
        """The block's first forward, for ``committed`` of length L: the pairs at the positions
        from the first one the cache cannot keep up to L - 2, whose output gives the first drafted
        token (cache: always None, as a head cache does not fork). None when there is nothing to
        build them from (no target features yet: the first round, whose block stays empty). When
        the target's features for positions the cache lacks never came (the target settled tokens
        alone during a load-aware pause, or a re-attached session), the head starts afresh from
        the first feature it has: it attends to what comes after only, a shorter context, never a
        wrong one."""
        last = len(committed) - 2
        if last < 0:
            return None
        pairs = self._plan(committed, last, self._offset, fresh=False)
        if pairs is None and self._stash is not None and self._offset < self._stash_from <= last:
            pairs = self._plan(committed, last, self._stash_from, fresh=True)
        return pairs

    def _plan(self, committed: Sequence[int], last: int, offset: int, fresh: bool):
        """The first forward's pairs up to position ``last``, for a cache whose position 0 is the
        sequence's position ``offset`` (fresh: an empty one there)."""
        fed, true = ([], 0) if fresh else (self._fed, self._true)
        last -= offset  # positions from here on count from the cache's first
        if last < 0:
            return None
        valid = common_prefix(fed, list(committed[offset + 1 :]))  # cached pairs whose tokens still hold
        keep = min(valid, last)  # the last pair is always fed again: its output is the first token's
        known = self._known - offset
        if known > true:
            keep = min(keep, true)  # the target's features replace the head's own
        true_end = min(known, last + 1)
        if keep < true_end and (self._stash is None or self._stash_from - offset > keep):
            return None  # the features for these positions are gone
        own_from = max(keep, true_end)  # pairs from here on are built on the head's outputs
        if last >= own_from and own_from < 1:
            return None  # no target feature to start from
        own_end = max(own_from, min(last, valid) + 1)  # where the kept outputs run out: a chain after
        at = offset - self._stash_from
        raw = self._stash[at + keep : at + true_end] if keep < true_end else None
        own = self._outputs[own_from - 1 : own_end - 1].clone() if own_end > own_from else None
        return _Pairs(offset, keep, raw, own, list(committed[offset + keep + 1 : offset + own_end + 1]),
                      list(committed[offset + own_end + 1 : offset + last + 2]))

    def _advance(self, pending) -> torch.Tensor:
        """The head's forward for a block's next token: its last output row [1, h]."""
        if not isinstance(pending, _Pairs):  # the token just drafted, beside the head's own last output
            return self._feed(self._last_output(), pending)
        if pending.offset != self._offset:  # afresh from the first feature there is
            self._cache, self._fed, self._true, self._offset = HeadCache(), [], 0, pending.offset
            self._drafter.fresh_starts += 1
        self._rollback(pending.first)
        if pending.ids:
            parts = [self._drafter.head.fc(pending.raw)] if pending.raw is not None else []
            out = self._feed(torch.cat(parts + ([pending.own] if pending.own is not None else [])), pending.ids)
            if pending.raw is not None:
                self._true = pending.first + pending.raw.shape[0]
                self._trim(self._offset + self._true - 1)
        for token in pending.chain:  # one pair at a time: each reads the output before it
            out = self._feed(self._last_output(), [token])
        return out

    def _last_output(self) -> torch.Tensor:
        """The head's output at the cache's last position [1, h]: the feature of the next pair."""
        return self._outputs[len(self._cache) - 1 : len(self._cache)]

    def _feed(self, features: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """Pairs (features [n, h], e(ids)) after what the cache holds: their last output [1, h]."""
        drafter = self._drafter
        embeds = drafter.embedding(torch.tensor(ids, dtype=torch.long, device=features.device))
        start = len(self._cache)
        outputs = drafter.head(embeds, features, self._cache)
        self._keep_outputs(start, outputs)
        self._fed += ids
        return outputs[-1:]

    def _rollback(self, length: int) -> None:
        self._cache.rollback(length)
        del self._fed[length:]
        self._true = min(self._true, length)

    def _keep_outputs(self, start: int, rows: torch.Tensor) -> None:
        end = start + rows.shape[0]
        if self._outputs is None or end > self._outputs.shape[0]:
            grown = rows.new_empty((max(end, 2 * (0 if self._outputs is None else self._outputs.shape[0]), 64),
                                    rows.shape[1]))
            if start:
                grown[:start] = self._outputs[:start]
            self._outputs = grown
        self._outputs[start:end] = rows

    def _trim(self, first: int) -> None:
        """Drop kept features before position ``first`` (the last taken in stays, to be re-fed)."""
        if self._stash is not None and first > self._stash_from:
            self._stash = self._stash[first - self._stash_from :]
            self._stash_from = first


@dataclass
class CacheUse:
    """The head caches' size, in the terms a KV pool reports (a page per token): what the draft
    worker's stats and metrics show."""

    pages: int
    used_pages: int
    page_size: int = 1

    @property
    def free_pages(self) -> int:
        return max(0, self.pages - self.used_pages)


@dataclass
class _Pairs:
    """A block's first forward: pairs at positions first .. first + len(ids) - 1, their features the
    target's (``raw``) then the head's own kept outputs (``own``)."""

    offset: int  # the sequence position of the cache's first (another than the session's: start afresh)
    first: int  # the first pair's cache position
    raw: torch.Tensor | None  # the target's features [n, layers x h] at first ..
    own: torch.Tensor | None  # then the head's kept outputs [m, h] for the positions after those
    ids: list[int]  # the tokens after each of those positions: x_{first+1} ..
    chain: list[int]  # then positions whose feature is the output just before: fed one at a time

    def __len__(self) -> int:
        return len(self.ids) + len(self.chain)
