"""The cache adapter: the only module that touches transformers' cache and attention API.

A ``KVPool`` holds one model's keys and values for many sequences in fixed-size pages (vLLM's
paged KV cache): one tensor per key and value, [layers, slots, kv_heads, head_dim], a slot being
a page's place for one token. A ``PagedSequence`` is one session's place in it: a page table and
the tokens whose keys and values the pages hold. Rolling back after a rejection truncates the
sequence and frees its whole pages past the new end; closing it frees everything. A sequence
forks (``PagedSequence.fork``): the fork shares every page, each counted once in the pool, and a
page either of them writes into while the other still holds it is copied first (copy on write), so
a draft prepares several continuations of one prefix side by side without copying the prefix.

``KVPool.forward`` runs one forward over a ragged batch: every sequence's new tokens flattened
into one row [1, total] with their own positions (vLLM's way: no padding to the longest), the new
keys and values written to each sequence's pages, and each sequence's queries attending to its own
pages only, causally. What each layer needs is worked out once per forward (``_Ragged``). The
step's short items (decode and verify rows) are attended in one SDPA call per layer per group
(``_Packed``): their keys gathered as [items, longest] in one ``index_select``, each item's own
masked in, queries padded to the widest item; items go together while that padding stays within
twice the keys they hold. Long items (prefill chunks), and a short one with nobody of its length,
are attended on their own: a sequence's pages are placed as one run where the pool has room
(``_FreePages``), and then its keys and values are a view of the pool, not a copy. There is no
varlen attention kernel on a CPU; the packed call is what a GPU's varlen kernel would replace.

Batched is not bitwise alone: a GEMM over 16 rows rounds differently from one over 1, and so does
the padded attention, so a sequence's logits in a batch equal its logits alone to float rounding
(tests/unit/test_kv_cache.py: allclose and the same argmax against a per-sequence gather; the
sequences attended on their own are bitwise that gather).

A model of a layout ``PoolDecoder`` knows (Llama, Mistral, Qwen2, Qwen3; svip_common/pool_decoder.py)
is run by it, layer by layer over the step's plan (``_Ragged.write``, ``_Ragged.attend``), without
the modules' machinery and bitwise the same logits; any other model runs through its own
modules, and transformers reaches the pool through two hooks: a cache object whose
``update`` writes the new keys and values (the forward's ``cache=`` argument, so named since 5.24),
and an attention function registered under ``ATTENTION`` that the model's config names for the
duration of the forward. Why not transformers' own ``PagedAttentionCache``: it is built for its
generate loop (its scheduler's request states, read / write indices it computes), and a rejection
needs a sequence truncated mid-page and continued, which it does not offer.

A release of transformers that moves this API changes this file alone
(tests/unit/test_kv_cache.py pins the behaviour against the model's own forward).
"""

from __future__ import annotations

import contextlib
import time
from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from transformers import AttentionInterface, PreTrainedModel

from svip_common.attention import grouped_sdpa
from svip_common.errors import InvalidRequest, ModelLoadError, SvipError
from svip_common.kv_sizes import PAGE_SIZE
from svip_common.pool_decoder import PoolDecoder
from svip_common.test_hooks import forward_delay
from svip_common.trees import ancestors_mask, depths

ATTENTION = "svip_ragged"


class PoolFull(SvipError):
    """The pool has too few free pages for what was asked."""


class KVPool:
    def __init__(self, model: PreTrainedModel, tokens: int, page_size: int = PAGE_SIZE, flat: bool = True):
        """flat: run a model whose layout ``PoolDecoder`` knows through it (False: always through
        transformers' modules and the hooks below; the same logits, bitwise on a CPU)."""
        config = model.config.get_text_config(decoder=True)
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise ModelLoadError(f"{config.model_type}: sliding-window attention is not supported by the paged KV pool")
        self.model, self.page_size = model, page_size
        self.layers = config.num_hidden_layers
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.pages = max(1, -(-tokens // page_size))
        shape = (self.pages * page_size, kv_heads, head_dim)
        # per layer, on that layer's device (a model spread over GPUs keeps each layer's cache beside it)
        devices = _layer_devices(model, self.layers)
        self.keys = [torch.zeros(shape, dtype=model.dtype, device=d) for d in devices]
        self.values = [torch.zeros(shape, dtype=model.dtype, device=d) for d in devices]
        self.device = devices[0]  # where page tables live
        self._free = _FreePages(self.pages)
        self._shared: dict[int, int] = {}  # a page held by more than one sequence: its other holders
        self.staging = StepBuffer(self.device)  # a forward's index inputs, in one copy
        self.max_forward_tokens = 0  # the most tokens any forward has held (max_batched_tokens bounds it)
        self.forward_tokens = 0  # tokens through every forward, in all
        self.forwards = 0  # forwards run
        self.decoder = PoolDecoder.of(model) if flat else None
        self.timing = None  # device timing on this machine (svip_common/device_timing.py): None, as the model runs
        # a tensor-parallel rank's shard (svip_common/tensor_parallel.py): rank 0 plans every step and
        # sends it with what changed in its pages since (``_sent``); the other ranks follow (``follow``)
        self.shard = getattr(model, "svip_tp", None)
        if self.shard is not None and self.decoder is None:
            raise ModelLoadError(f"{config.model_type}: tensor parallel runs the flat decoder's layouts only "
                                 "(svip_common/pool_decoder.py)")
        self._changes: list[tuple] = []  # rank 0: page copies and slot moves since the last step
        self._followed_as: int | None = None  # rank 0: the id the other ranks know this pool by
        if self._leads:  # the other ranks make a pool of this one's pages (its heads alone)
            self._followed_as = self.shard.group.new_pool_id()
            self.shard.group.send(("pool", self._followed_as, self.pages * page_size, page_size))

    @property
    def tokens(self) -> int:
        """Capacity in tokens."""
        return self.pages * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.pages - len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def sequence(self) -> PagedSequence:
        return PagedSequence(self)

    def _take(self, n: int, after: int | None = None) -> list[int]:
        """n free pages for a sequence whose last page is ``after`` (None: a new sequence)."""
        if n > len(self._free):
            raise PoolFull(
                f"the KV pool has {len(self._free)} free pages of {self.page_size} tokens; {n} more are needed"
            )
        return self._free.take(n, after)

    def _give(self, pages: list[int]) -> None:
        """A sequence lets go of these pages: each is free once its last holder has let go."""
        free = []
        for page in pages:
            others = self._shared.get(page, 0)
            if others > 1:
                self._shared[page] = others - 1
            elif others == 1:
                del self._shared[page]
            else:
                free.append(page)
        self._free.give(free)

    def _share(self, pages: list[int]) -> None:
        for page in pages:
            self._shared[page] = self._shared.get(page, 0) + 1

    def shared(self, page: int) -> bool:
        return page in self._shared

    def _copy_page(self, source: int, dest: int) -> None:
        """Every layer's keys and values of one page into another."""
        ps = self.page_size
        self._changed(("copy", source, dest))
        for keys, values in zip(self.keys, self.values):
            keys[dest * ps : (dest + 1) * ps] = keys[source * ps : (source + 1) * ps]
            values[dest * ps : (dest + 1) * ps] = values[source * ps : (source + 1) * ps]

    def _move_slots(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Every layer's keys and values at the source slots into the dest slots."""
        self._changed(("move", source.tolist(), dest.tolist()))
        for keys, values in zip(self.keys, self.values):
            keys.index_copy_(0, dest.to(keys.device), keys.index_select(0, source.to(keys.device)))
            values.index_copy_(0, dest.to(values.device), values.index_select(0, source.to(values.device)))

    @property
    def _leads(self) -> bool:
        """A tensor-parallel rank 0 of several: what changes its pages goes to the other ranks."""
        return self.shard is not None and self.shard.group.world > 1 and self.shard.group.first

    def _changed(self, change: tuple) -> None:
        if self._leads:
            self._changes.append(change)

    def _follow(self, changes: list[tuple], steps: list[tuple], ids, positions, keep, layers) -> None:
        """A following rank: the step rank 0 sent (``_forward_features``), after what it changed in
        its pages since its last step."""
        for kind, source, dest in changes:
            if kind == "copy":
                self._copy_page(source, dest)
            else:
                self._move_slots(torch.tensor(source), torch.tensor(dest))
        followed = [(_Followed(held, slots, run), n, *tree) for held, slots, run, n, tree in steps]
        meta = _Ragged.plan(self, followed, inputs=(ids, positions, keep))
        self.decoder.run(*meta.inputs, meta, tuple(layers))

    def close(self) -> None:
        """A tensor-parallel rank 0: the other ranks let their pool of this one go (a pool made for a
        one-off pass, calibration's); a pool of one model, nothing."""
        if self._leads and self._followed_as is not None:
            self.shard.group.send(("drop", self._followed_as))
            self._followed_as = None

    def timed_forward(self, steps: Sequence[tuple[PagedSequence, Sequence[int], int]], layers: Sequence[int] = ()
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
        """``forward_features`` and its seconds on the device: the clock stops once the device has
        finished the step (on a GPU the call returns when the kernels are queued; load-aware
        speculation must see what the step costs, not what it takes to launch). On a virtual
        device (svip_common/device_timing.py) the step's modelled time: what it would cost there."""
        started = time.perf_counter()
        rows, features = self.forward_features(steps, layers)
        wait_for_device(self.device)
        if self.timing is not None and self.timing.virtual:
            return rows, features, self.timing.last_s
        return rows, features, time.perf_counter() - started

    def forward(self, steps: Sequence[tuple[PagedSequence, Sequence[int], int]]) -> list[torch.Tensor]:
        """One forward over a ragged batch. steps: (sequence, new token ids, k): each sequence's
        new tokens go after the ones it holds; returns, per step, the logits of its last k new
        tokens, [k, vocab] (k = 0: a prefill chunk, no logits). Raises PoolFull (nothing
        changed) when the pages do not fit."""
        return self.forward_features(steps)[0]

    @torch.inference_mode()
    def forward_features(self, steps: Sequence[tuple[PagedSequence, Sequence[int], int]],
                         layers: Sequence[int] = ()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``forward``, and with ``layers`` (indices into the model's hidden states: 0 the
        embeddings, i the output of layer i) each step's hidden states there at every new token,
        side by side: [new tokens, len(layers) x hidden] per step (a feature draft's input)."""
        forward_delay()
        if self.timing is None:
            return self._forward_features(steps, layers)
        with self.timing.forward([(len(step[1]), len(step[0])) for step in steps]):
            return self._forward_features(steps, layers)

    def _forward_features(self, steps: Sequence[tuple[PagedSequence, Sequence[int], int]],
                          layers: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        need = sum(max(0, step[0].pages_needed(len(step[1]))) for step in steps)
        if need > len(self._free):
            raise PoolFull(
                f"the KV pool has {len(self._free)} free pages of {self.page_size} tokens; {need} are needed"
            )
        ids, positions, keep = [], [], []
        for seq, new, k, *tree in steps:
            if not new or not 0 <= k <= len(new):
                raise ValueError(f"a step needs new tokens and 0 <= k <= their count, got {len(new)} and {k}")
            seq._grow(len(new))
            start = len(seq)
            keep += range(len(ids) + len(new) - k, len(ids) + len(new))
            ids += new
            positions += [start + d for d in depths(tree[0])] if tree else range(start, start + len(new))
        self.max_forward_tokens = max(self.max_forward_tokens, len(ids))
        self.forward_tokens += len(ids)
        self.forwards += 1
        meta = _Ragged.plan(self, [(step[0], len(step[1]), *step[3:]) for step in steps],
                            inputs=(ids, positions, keep))
        if self._leads:  # the other ranks run the same step on their shards
            if self._followed_as is None:
                raise InvalidRequest("this tensor-parallel KV pool was closed")
            planned = [(len(seq), seq._slots_upto(len(seq) + len(new)).tolist(), seq._run, len(new), tuple(tree))
                       for seq, new, _, *tree in steps]
            self.shard.group.send(("step", self._followed_as, self._changes, planned, ids, positions, keep,
                                   tuple(layers)))
            self._changes = []
        ids_, positions_, keep_ = meta.inputs
        if self.decoder is not None:
            logits, hidden = self.decoder.run(ids_, positions_, keep_, meta, tuple(layers))
        else:
            logits, hidden = self._through_modules(ids_, positions_, keep_, meta, layers)
        for seq, new, *_ in steps:
            seq.tokens.extend(new)
        rows = []  # logits: [sum of k, vocab]
        for _, _, k, *_ in steps:
            rows.append(logits[:k])
            logits = logits[k:]
        if not layers:
            return rows, []
        features = torch.cat([hidden[i].to(self.model.device) for i in layers], dim=-1)  # [total, layers x h]
        return rows, list(features.split([len(step[1]) for step in steps]))

    def _through_modules(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, meta: _Ragged,
                         layers: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The forward through transformers' own modules, the pool reached through its hooks."""
        with _ragged_attention(self.model):
            out = self.model(
                input_ids=ids[None].to(self.model.device),
                position_ids=positions[None].to(self.model.device),
                cache=_PoolWriter(meta),
                use_cache=True,
                logits_to_keep=keep.to(self.model.device),
                output_hidden_states=bool(layers),
                svip_ragged=meta,
            )
        return out.logits[0], {i: out.hidden_states[i][0] for i in layers}


class PagedSequence:
    """One sequence's pages in a pool and the tokens they hold. Rolling back is one call:
    ``rollback_to_prefix_of(sequence)`` keeps the longest prefix it shares with ``sequence``."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.pages: list[int] = []
        self.tokens: list[int] = []
        self._slots: torch.Tensor | None = None  # every page's slots, in order (rebuilt on change)
        self._run: int | None = None  # the first slot, when the pages are one ascending run (else None)

    def __len__(self) -> int:
        return len(self.tokens)

    def forward(self, token_ids: Sequence[int], logits_to_keep: int = 1) -> torch.Tensor:
        """The new tokens after the ones held; the last logits_to_keep rows of logits [k, vocab]."""
        return self.pool.forward([(self, list(token_ids), logits_to_keep)])[0]

    @property
    def one_run(self) -> bool:
        """Its pages are one ascending run of the pool's: its keys and values are read as a view."""
        first = self.pages[0] if self.pages else 0
        return self.pages == list(range(first, first + len(self.pages)))

    def pages_needed(self, new_tokens: int) -> int:
        """Pages to take for new_tokens more: new ones, and the shared page they would write into
        (copied first)."""
        grow = self.pool.pages_for(len(self.tokens) + new_tokens) - len(self.pages)
        return grow + (1 if new_tokens > 0 and self._shared_tail() is not None else 0)

    def fork(self) -> PagedSequence:
        """A sequence holding the same tokens in the same pages (none copied): what either writes
        into a page the other holds is copied first (copy on write)."""
        other = PagedSequence(self.pool)
        other.pages, other.tokens = list(self.pages), list(self.tokens)
        self.pool._share(self.pages)
        return other

    def rollback(self, length: int) -> None:
        """Forget every token past the first ``length``; whole pages past it go back to the pool."""
        if length >= len(self.tokens):
            return
        del self.tokens[length:]
        keep = self.pool.pages_for(length)
        if keep < len(self.pages):
            self.pool._give(self.pages[keep:])
            del self.pages[keep:]
            self._slots = None

    def rollback_to_prefix_of(self, sequence: Sequence[int], limit: int | None = None) -> int:
        """Keep the longest held prefix shared with ``sequence`` (at most ``limit`` tokens);
        returns the number of tokens kept."""
        keep = min(len(self.tokens), len(sequence) if limit is None else limit)
        if self.tokens[:keep] != list(sequence[:keep]):
            keep = next(i for i, (a, b) in enumerate(zip(self.tokens, sequence)) if a != b)
        self.rollback(keep)
        return keep

    def keep_path(self, base: int, spine: int, accepted: int, branch: Sequence[int] = ()) -> None:
        """After a tree step from ``base`` (its nodes held from there: the spine's ``spine``
        tokens, then the nodes off it): those are forgotten, and where some were taken after the
        ``accepted`` spine tokens (branch: their indices among the nodes, a sibling at the place
        after them, then its child, ...), their keys and values move into those places and the
        spine past them goes. A node's keys and values are exactly what a chain through it holds
        there (each attended to its ancestors only, at its depth), so what stays is the accepted
        path as a chain would have computed it."""
        if not branch:
            self.rollback(base + spine)
            return
        place = base + accepted
        for index in range(place // self.pool.page_size, (place + len(branch) - 1) // self.pool.page_size + 1):
            self._own(index)
        slots = self._slots_upto(len(self.tokens))
        src = slots[torch.tensor([base + node for node in branch])]
        dst = slots[place : place + len(branch)]  # before every source: a node off the spine lies past it
        self.pool._move_slots(src, dst)
        self.tokens[place : place + len(branch)] = [self.tokens[base + node] for node in branch]
        self.rollback(place + len(branch))

    def tokens_equal(self, sequence: Sequence[int]) -> bool:
        """Whether this holds exactly ``sequence`` (a list is compared without a copy)."""
        if len(self.tokens) != len(sequence):
            return False
        return self.tokens == (sequence if isinstance(sequence, list) else list(sequence))

    def close(self) -> None:
        """Give every page back."""
        self.pool._give(self.pages)
        self.pages, self.tokens, self._slots = [], [], None

    def _grow(self, new_tokens: int) -> None:
        tail = self._shared_tail()
        if tail is not None:
            self._own(tail)
        need = self.pages_needed(new_tokens)
        if need > 0:
            self.pages += self.pool._take(need, self.pages[-1] if self.pages else None)
            self._slots = None

    def _shared_tail(self) -> int | None:
        """The index of the page the next token goes into, if it is held and shared."""
        index = len(self.tokens) // self.pool.page_size
        return index if index < len(self.pages) and self.pool.shared(self.pages[index]) else None

    def _own(self, index: int) -> None:
        """Its page at ``index`` held by it alone: a shared one is copied into a page of its own."""
        page = self.pages[index]
        if not self.pool.shared(page):
            return
        (copy,) = self.pool._take(1, self.pages[index - 1] if index else None)
        self.pool._copy_page(page, copy)
        self.pool._give([page])
        self.pages[index] = copy
        self._slots = None

    def _slots_upto(self, length: int) -> torch.Tensor:
        """Its first ``length`` slots, on the host (a step's plan is built there and staged)."""
        if self._slots is None:
            pages = torch.tensor(self.pages, dtype=torch.long)
            offsets = torch.arange(self.pool.page_size)
            self._slots = (pages[:, None] * self.pool.page_size + offsets).reshape(-1)
            self._run = self.pages[0] * self.pool.page_size if self.pages and self.one_run else None
        return self._slots[:length]


def follow(model) -> None:
    """A tensor-parallel rank past 0 (svip_common/tensor_parallel.py), to the end: the pool rank 0
    makes, made alike on this rank's shard (its heads alone); every step rank 0 runs, run here on
    it (the collectives inside keep the ranks in lockstep); until rank 0 sends ("stop",)."""
    group, pools = model.svip_tp.group, {}
    while (message := group.receive())[0] != "stop":
        kind, pool_id, *rest = message
        if kind == "pool":
            pools[pool_id] = KVPool(model, *rest)
        elif kind == "drop":
            del pools[pool_id]
        else:
            pools[pool_id]._follow(*rest)


class _Followed:
    """A sequence as a following rank sees it: what rank 0 held before a step, its slots through
    the step, and whether they are one run (what ``_Ragged.plan`` reads of a PagedSequence)."""

    def __init__(self, held: int, slots: list[int], run: int | None):
        self._held, self._slots, self._run = held, torch.tensor(slots, dtype=torch.long), run

    def __len__(self) -> int:
        return self._held

    def _slots_upto(self, length: int) -> torch.Tensor:
        return self._slots[:length]


class _FreePages:
    """A pool's free pages, sorted, and where a sequence's next pages go: each sequence is kept one
    run of pages where the pool has room, so that its keys and values are a view, not a gather. A
    sequence grows into the page after its last one when that page is free; a new sequence starts
    where it leaves the most room to grow (the middle of the longest free run, or its start when no
    page before it is held), so sequences growing side by side do not interleave. When the page a
    run needs is taken, the lowest free page is used (the sequence is then gathered, as exact)."""

    def __init__(self, pages: int):
        self._free = list(range(pages))
        # the maximal runs of free pages: their starts, sorted, and each one's length (kept as
        # pages are taken and given, so a new sequence's start is found without a scan of every page)
        self._starts = [0] if pages else []
        self._lengths = {0: pages} if pages else {}

    def __len__(self) -> int:
        return len(self._free)

    def take(self, n: int, after: int | None) -> list[int]:
        taken, want = [], self._roomiest() if after is None else after + 1
        for _ in range(n):
            i = bisect_left(self._free, want)
            page = self._free.pop(i if i < len(self._free) and self._free[i] == want else 0)
            self._out_of_run(page)
            taken.append(page)
            want = page + 1
        return taken

    def give(self, pages: Sequence[int]) -> None:
        for page in pages:
            insort(self._free, page)
            self._into_run(page)

    def _roomiest(self) -> int:
        """Where a new sequence starts: the middle of the longest free run (the first of the
        longest; its start if it is the pool's first page, before which no sequence can be growing)."""
        best_start, best_len = 0, 0
        for start in self._starts:
            if self._lengths[start] > best_len:
                best_start, best_len = start, self._lengths[start]
        return best_start if best_start == 0 else best_start + best_len // 2

    def _out_of_run(self, page: int) -> None:
        """A free page was taken: its run splits into what lies before and after it."""
        i = bisect_right(self._starts, page) - 1
        start = self._starts.pop(i)
        length = self._lengths.pop(start)
        if page > start:
            self._starts.insert(i, start)
            self._lengths[start] = page - start
        if page + 1 < start + length:
            insort(self._starts, page + 1)
            self._lengths[page + 1] = start + length - page - 1

    def _into_run(self, page: int) -> None:
        """A page came back: it joins the run ending before it and the run starting after it."""
        i = bisect_right(self._starts, page) - 1
        if i >= 0 and self._starts[i] + self._lengths[self._starts[i]] == page:
            start = self._starts[i]
            self._lengths[start] += 1
        else:
            start = page
            self._starts.insert(i + 1, page)
            self._lengths[page] = 1
        if page + 1 in self._lengths:
            self._lengths[start] += self._lengths.pop(page + 1)
            del self._starts[bisect_left(self._starts, page + 1)]


def _tree_mask(cached: int, parents: Sequence[int]) -> torch.Tensor:
    """A tree step's mask [new, cached + new]: every cached key, and each node's ancestors and itself."""
    tree = torch.tensor(ancestors_mask(parents), dtype=torch.bool).reshape(len(parents), len(parents))
    return torch.cat([torch.ones(len(parents), cached, dtype=torch.bool), tree], dim=1)


@dataclass
class _Item:
    """A sequence attended on its own: a prefill chunk, or a step with one short item."""

    start: int  # where its new tokens begin in the flattened row
    length: int  # how many new tokens
    total: int  # how many tokens it holds after this forward (its keys and values)
    read: int  # where its keys begin: a slot of the pool (run) or a row of the step's gather
    run: bool  # its keys are one run of the pool's slots (a view), else rows of the gather
    mask: torch.Tensor | None = None  # [length, total] causal, lower right, after cached keys (made when staged)
    tree: torch.Tensor | None = None  # [length, total] a tree step's mask, on the host: cached keys and ancestors

    @property
    def causal(self) -> bool:
        """A prefill from nothing (several new tokens, no keys before them): attended with
        ``is_causal``, no mask."""
        return self.tree is None and 1 < self.length == self.total


@dataclass
class _Packed:
    """The step's short items (decode and verify rows), attended in one SDPA call per layer: their
    keys and values gathered into [items, longest] (padding masked out), their queries padded to
    the most new tokens of any. On a CPU, where there is no varlen kernel, this replaces one call
    per sequence and layer (each ~10 small ops around the kernel) by one; the padding costs at most
    ``PACK_MAX_NEW`` query rows per item and the longest sequence's keys. Planned on the host;
    its index tensors reach the device with the step's others (``StepBuffer``)."""

    slots: torch.Tensor  # [items * longest] pool slots, each item's own, padded with its first
    queries: torch.Tensor | None  # [items * widest] rows of the flattened step (None: one each, in order)
    seen: torch.Tensor | None  # [items, widest] how many keys each query may see; None when nothing is masked
    rows: torch.Tensor | None  # [their new tokens] the real rows of [items * widest] (None: all)
    items: int
    widest: int  # the most new tokens of any item
    longest: int  # the most tokens any item holds
    mask: torch.Tensor | None = None  # [items, 1, widest, longest] may attend (made from seen when staged)
    explicit: torch.Tensor | None = None  # [items, widest, longest] on the host: a group holding a tree step

    @staticmethod
    def plan(items: list[tuple[torch.Tensor, int, int, int, torch.Tensor | None]]) -> _Packed:
        """items: (host slots, start, new tokens, total, a tree step's mask or None) in the step's order."""
        count, widest, longest = len(items), max(item[2] for item in items), max(item[3] for item in items)
        totals = torch.tensor([item[3] for item in items])
        news = torch.tensor([item[2] for item in items])
        firsts = totals.cumsum(0) - totals  # where each item's slots begin in their concatenation
        columns = torch.arange(longest)[None, :]
        slots = torch.cat([item[0] for item in items])[
            firsts[:, None] + torch.where(columns < totals[:, None], columns, 0)]  # padded with its first
        in_order = widest == 1 and [item[1] for item in items] == list(range(count))  # the step's first rows
        queries = rows = None
        if not in_order:
            offsets = torch.arange(widest)
            starts = torch.tensor([item[1] for item in items])
            queries = (starts[:, None] + torch.minimum(offsets[None, :], news[:, None] - 1)).reshape(-1)
            rows = (torch.arange(count)[:, None] * widest + offsets[None, :])[offsets[None, :] < news[:, None]]
        seen = None
        if widest > 1 or min(item[3] for item in items) != longest:
            # query i of an item holding T tokens, n of them new, sees keys up to T - n + i (its
            # padded rows see all of its keys: finite, and dropped)
            seen = torch.minimum(totals[:, None] - news[:, None] + torch.arange(widest) + 1, totals[:, None])
        explicit = None
        if any(item[4] is not None for item in items):  # a tree among them: each item's mask in full
            bounds = seen if seen is not None else totals[:, None].expand(count, widest)
            explicit = torch.arange(longest)[None, None, :] < bounds[:, :, None]
            for i, (*_, n, total, tree) in enumerate(items):
                if tree is not None:
                    explicit[i, :n, :total] = tree
            seen = None
        return _Packed(slots.reshape(-1), queries, seen, rows, count, widest, longest, explicit=explicit)

    def make_mask(self) -> None:
        """The mask, on the device its bounds were staged to (one comparison, no host copy); a
        group holding a tree step: its mask, made on the host, copied over."""
        if self.explicit is not None:
            self.mask = self.explicit.to(self.slots.device).unsqueeze(1)
        elif self.seen is not None:
            keys = torch.arange(self.longest, device=self.seen.device)
            self.mask = (keys[None, None, :] < self.seen[:, :, None]).unsqueeze(1)

    def attend(self, query, keys, values, scaling) -> torch.Tensor:
        """query [1, heads, total, d] -> this group's rows [their new tokens, heads, d], in its order."""
        heads, d = query.shape[1], query.shape[-1]
        slots = self.slots.to(keys.device)  # a no-op unless the model spans devices
        k = keys.index_select(0, slots).view(self.items, self.longest, *keys.shape[1:]).transpose(1, 2)
        v = values.index_select(0, slots).view(self.items, self.longest, *values.shape[1:]).transpose(1, 2)
        if self.queries is None:  # one new token each, the step's first rows in order
            q = query[0, :, : self.items].transpose(0, 1).unsqueeze(2)  # [items, heads, 1, d]
        else:
            q = query[0].index_select(1, self.queries.to(query.device)).view(heads, self.items, self.widest, d)
            q = q.transpose(0, 1)
        mask = None if self.mask is None else self.mask.to(q.device)
        o = grouped_sdpa(q, k, v, mask, scaling)
        o = o.transpose(1, 2).reshape(self.items * self.widest, heads, d)
        return o if self.rows is None else o.index_select(0, self.rows.to(o.device))


# Items with at most this many new tokens are attended together (decode and verify rows); longer
# ones (prefill chunks) alone, so one long item does not pad every other's queries to its length.
PACK_MAX_NEW = 32
# A packed call's keys are gathered as [items, longest]: items go together only while that is at
# most twice the keys they hold and at most this many slots (the copy's size, per layer).
PACK_MAX_SLOTS = 1 << 18


def _pack_groups(short: list[tuple]) -> tuple[list[list[tuple]], list[tuple]]:
    """short: (sequence, slots, start, new, total) of the step's short items. Groups of at least
    two (longest first; each in the step's order) and the items left on their own."""
    groups, alone, rest = [], [], sorted(short, key=lambda item: -item[4])
    while rest:
        longest = rest[0][4]
        fits = max(1, min(PACK_MAX_SLOTS // longest, len(rest)))
        group = [item for item in rest[:fits] if 2 * item[4] >= longest]
        rest = rest[len(group):]
        if len(group) > 1:
            groups.append(sorted(group, key=lambda item: item[2]))
        else:
            alone += group
    return groups, alone


@dataclass
class _Ragged:
    """What every layer of one forward needs, worked out once: planned on the host, every index
    tensor then staged to the device in one copy (``StepBuffer``), the masks made there."""

    pool: KVPool
    packs: list[_Packed]  # attended a group at a time
    items: list[_Item]  # attended one by one
    write_slots: torch.Tensor  # [total new tokens] the slot each new token's keys and values go to
    gather: torch.Tensor | None  # the slots of every single item not held in one run, in item order
    order: torch.Tensor | None  # rows of [packs' rows; single items' rows] in the step's order (None: as is)
    inputs: list[torch.Tensor]  # the forward's own index inputs (ids, positions, kept rows), staged alongside

    @staticmethod
    def plan(pool: KVPool, steps: Sequence[tuple], inputs: Sequence[Sequence[int]] = ()) -> _Ragged:
        """steps: (sequence, new tokens[, parents]) after each sequence has grown its pages for
        them (parents: a tree step's, each new token's parent among them, -1: the cached tokens;
        attended alone, under its own mask); inputs: integer lists the forward takes as tensors,
        staged in the same copy."""
        writes, start, short, long_, trees = [], 0, [], [], {}
        for seq, n, *tree in steps:
            total = len(seq) + n
            slots = seq._slots_upto(total)
            writes.append(slots[-n:])
            if tree:
                trees[start] = _tree_mask(len(seq), tree[0])
            (short if n <= PACK_MAX_NEW else long_).append((seq, slots, start, n, total))
            start += n
        groups, alone = _pack_groups(short)
        singles = sorted(alone + long_, key=lambda item: item[2])
        packs = [_Packed.plan([(*item[1:], trees.get(item[2])) for item in group]) for group in groups]
        items, gathers, gathered = [], [], 0
        for seq, slots, start, n, total in singles:
            if seq._run is not None:
                items.append(_Item(start, n, total, seq._run, True, tree=trees.get(start)))
            else:
                items.append(_Item(start, n, total, gathered, False, tree=trees.get(start)))
                gathers.append(slots)
                gathered += total
        gather = torch.cat(gathers) if gathers else None
        segments = [(s, n) for _, _, s, n, _ in [it for group in groups for it in group] + singles]
        starts = [0] + list(accumulate(n for _, n in segments))[:-1]  # where each would begin in step order
        order = None
        if [s for s, _ in segments] != starts:  # attended out of the step's order: put the rows back
            flat = torch.cat([torch.arange(s, s + n) for s, n in segments])  # the rows as attended
            order = torch.empty(len(flat), dtype=torch.long)
            order[flat] = torch.arange(len(flat))
        inputs = [torch.tensor(values, dtype=torch.long) for values in inputs]
        meta = _Ragged(pool, packs, items, torch.cat(writes), gather, order, inputs)
        meta._stage()
        return meta

    def _stage(self) -> None:
        """Every index tensor to the device in one copy; then the masks, made there."""
        fields = [(self, "write_slots"), (self, "gather"), (self, "order")]
        fields += [(pack, name) for pack in self.packs for name in ("slots", "queries", "seen", "rows")]
        fields = [(owner, name) for owner, name in fields if getattr(owner, name) is not None]
        staged = self.pool.staging.upload(self.inputs + [getattr(owner, name) for owner, name in fields])
        self.inputs = staged[: len(self.inputs)]
        for (owner, name), tensor in zip(fields, staged[len(self.inputs):]):
            setattr(owner, name, tensor)
        for pack in self.packs:
            pack.make_mask()
        for item in self.items:
            if item.tree is not None:
                item.mask = item.tree.to(self.pool.device)
            elif item.length > 1 and not item.causal:  # causal, lower right, after cached keys
                n, total = item.length, item.total
                item.mask = torch.ones(n, total, dtype=torch.bool, device=self.pool.device).tril(total - n)

    def write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A layer's new keys and values [1, kv_heads, total, head_dim] into their slots of the pool."""
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        write = self.write_slots.to(keys.device)  # a no-op unless the model spans devices
        keys.index_copy_(0, write, key_states[0].transpose(0, 1))  # [total, kv_heads, head_dim]
        values.index_copy_(0, write, value_states[0].transpose(0, 1))

    def attend(self, layer: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """query [1, heads, total, head_dim]: each sequence's queries attend to its own keys and
        values in the pool (those before, and its new ones causally); returns [1, total, heads, head_dim]."""
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        outs = [pack.attend(query, keys, values, scaling) for pack in self.packs]
        if self.gather is not None:  # one gather per layer for every single item not held in one run
            gather = self.gather.to(keys.device)  # a no-op unless the model spans devices
            gathered_keys, gathered_values = keys.index_select(0, gather), values.index_select(0, gather)
        for item in self.items:
            q = query[:, :, item.start : item.start + item.length]  # [1, heads, n, d]
            k_src, v_src = (keys, values) if item.run else (gathered_keys, gathered_values)
            k = k_src.narrow(0, item.read, item.total).permute(1, 0, 2).unsqueeze(0)  # [1, kv_heads, L, d]
            v = v_src.narrow(0, item.read, item.total).permute(1, 0, 2).unsqueeze(0)
            mask = None if item.mask is None else item.mask.to(q.device)
            o = grouped_sdpa(q, k, v, mask, scaling, causal=item.causal)
            outs.append(o[0].transpose(0, 1))  # [n, heads, d]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if self.order is not None:
            out = out.index_select(0, self.order.to(out.device))
        return out.unsqueeze(0).contiguous()

class StepBuffer:
    """A pool's persistent staging for one forward's index tensors (ids, positions, kept rows,
    write slots, gathers, packed layouts, mask bounds), planned on the host: on a device, written
    into one host buffer and copied over in one transfer (from pinned memory, asynchronously, on
    CUDA) into one device buffer, of which each tensor is a view, instead of a synchronous copy
    and a few small kernels per tensor. Both buffers live as long as the pool and grow by
    doubling; the step's shapes are whatever its plan asks (no buckets). On a CPU the host tensors
    are where the model reads them: nothing is staged (``through_buffer`` stages anyway, to check
    the path on a host)."""

    def __init__(self, device: torch.device, through_buffer: bool | None = None):
        self.device = device
        self.through_buffer = device.type != "cpu" if through_buffer is None else through_buffer
        self.copies = 0  # transfers made (one per forward)
        self._pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.long)
        self._device = self._host
        self._copied = None  # CUDA event: the last copy out of the host buffer has run

    @torch.inference_mode()
    def upload(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """parts (host int64 tensors) on the device, as views of its buffer, in one copy. The
        views hold until the next upload (the forward that uses them is queued before it)."""
        if not self.through_buffer:
            return parts
        sizes = [part.numel() for part in parts]
        total = sum(sizes)
        if total > self._host.numel():
            size = max(total, 2 * self._host.numel(), 1024)
            self._host = torch.empty(size, dtype=torch.long, pin_memory=self._pinned)
            self._device = torch.empty(size, dtype=torch.long, device=self.device)
        elif self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the host buffer
        torch.cat([part.reshape(-1) for part in parts], out=self._host[:total])
        staged = self._device[:total]
        staged.copy_(self._host[:total], non_blocking=self._pinned)
        self.copies += 1
        if self._pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return [view.view(part.shape) for view, part in zip(staged.split(sizes), parts)]


class _PoolWriter:
    """The forward's cache: writes each layer's new keys and values into the pool."""

    def __init__(self, meta: _Ragged):
        self.meta = meta

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs=None, **_):
        self.meta.write(layer_idx, key_states, value_states)
        return key_states, value_states


def _ragged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention hook: the pool's attention for the forward's plan (keys and values
    were written by the cache's ``update``)."""
    meta: _Ragged = kwargs["svip_ragged"]
    return meta.attend(module.layer_idx, query, scaling), None


AttentionInterface.register(ATTENTION, _ragged_attention_forward)


def wait_for_device(device: torch.device) -> None:
    """Block until the device has run what was queued on it (a no-op on a CPU, which runs eagerly)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _layer_devices(model: PreTrainedModel, layers: int) -> list[torch.device]:
    """Each decoder layer's device: the model's own unless it was spread (``device_map``)."""
    if not getattr(model, "hf_device_map", None):
        return [model.device] * layers
    try:
        return [next(layer.parameters()).device for layer in model.get_decoder().layers][:layers]
    except (AttributeError, StopIteration):
        return [model.device] * layers


@contextlib.contextmanager
def _ragged_attention(model: PreTrainedModel):
    """The model's attention is the pool's for one forward (its own otherwise: the same model
    object also serves Hugging Face's generate)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


class KVCache:
    """One sequence in a pool of its own, sized on demand: for one-off passes (calibration)."""

    def __init__(self, model: PreTrainedModel, tokens: int = 4096):
        self.sequence = KVPool(model, tokens).sequence()

    def close(self) -> None:
        """Its pool let go (a tensor-parallel model's other ranks drop theirs)."""
        self.sequence.pool.close()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def forward_features(self, token_ids: Sequence[int], layers: Sequence[int], logits_to_keep: int = 1
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward, and the hidden states at ``layers`` of every new token [n, len(layers) x hidden]."""
        rows, features = self.sequence.pool.forward_features([(self.sequence, list(token_ids), logits_to_keep)],
                                                             layers)
        return rows[0], features[0]

    def __len__(self) -> int:
        return len(self.sequence)

    @property
    def tokens(self) -> list[int]:
        return list(self.sequence.tokens)

    def forward(self, token_ids: Sequence[int], logits_to_keep: int = 1) -> torch.Tensor:
        return self.sequence.forward(token_ids, logits_to_keep)

    def rollback(self, length: int) -> None:
        self.sequence.rollback(length)

    def rollback_to_prefix_of(self, sequence: Sequence[int], limit: int | None = None) -> int:
        return self.sequence.rollback_to_prefix_of(sequence, limit)
