"""The cache adapter: the behaviour of transformers' cache API the engine relies on, pinned."""

from __future__ import annotations

import pytest
import torch

from svip_common.kv_cache import KVCache

TOKENS = [5, 17, 42, 8, 99, 23, 61, 7]


@pytest.fixture()
def model(models):
    return models["target"].model


def _full_logits(model, tokens):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0]  # [n, vocab]


@torch.inference_mode()
def test_incremental_forward_matches_full_forward(model):
    cache = KVCache(model)
    first = cache.forward(TOKENS[:5], logits_to_keep=5)
    rest = cache.forward(TOKENS[5:], logits_to_keep=3)
    full = _full_logits(model, TOKENS)
    assert first.shape == (5, full.shape[-1]) and rest.shape == (3, full.shape[-1])
    assert torch.allclose(torch.cat([first, rest]), full, atol=1e-4)
    assert len(cache) == len(TOKENS) and cache.tokens == TOKENS


@torch.inference_mode()
def test_rollback_then_continue_matches_fresh_cache(model):
    cache = KVCache(model)
    cache.forward(TOKENS, logits_to_keep=1)
    cache.rollback(3)
    assert len(cache) == 3 and cache.tokens == TOKENS[:3]
    branch = [11, 12]
    out = cache.forward(branch, logits_to_keep=2)
    assert torch.allclose(out, _full_logits(model, TOKENS[:3] + branch)[-2:], atol=1e-4)


@torch.inference_mode()
def test_rollback_to_prefix_of(model):
    cache = KVCache(model)
    cache.forward(TOKENS, logits_to_keep=1)
    assert cache.rollback_to_prefix_of(TOKENS[:6] + [1000, 1001]) == 6
    assert cache.rollback_to_prefix_of(TOKENS[:6] + [1, 2], limit=4) == 4
    assert cache.rollback_to_prefix_of([3]) == 0
    assert len(cache) == 0
    out = cache.forward(TOKENS[:2], logits_to_keep=1)
    assert torch.allclose(out, _full_logits(model, TOKENS[:2])[-1:], atol=1e-4)


@torch.inference_mode()
def test_rollback_past_the_end_is_a_no_op(model):
    cache = KVCache(model)
    cache.forward(TOKENS[:3], logits_to_keep=1)
    cache.rollback(10)
    assert len(cache) == 3


# --- the paged pool: ragged batches, pages, exactness against the model's own forward ----------

from svip_common.kv_cache import KVPool, PoolFull  # noqa: E402


@torch.inference_mode()
def test_a_ragged_batch_equals_each_sequence_alone(model):
    """Three sequences of different lengths, extended by different numbers of tokens in one
    forward, give the logits each gets from a full forward of its own tokens."""
    pool = KVPool(model, tokens=512, page_size=4)
    seqs = [pool.sequence() for _ in range(3)]
    prompts = [TOKENS, TOKENS[:3], [9, 10, 11, 12, 13]]
    first = pool.forward([(s, p, 1) for s, p in zip(seqs, prompts)])
    for p, row in zip(prompts, first):
        assert torch.allclose(row, _full_logits(model, p)[-1:], atol=1e-4)
    extra = [[1, 2, 3], [4], [5, 6]]
    second = pool.forward([(s, e, len(e)) for s, e in zip(seqs, extra)])
    for p, e, rows in zip(prompts, extra, second):
        full = _full_logits(model, p + e)
        assert rows.shape == (len(e), full.shape[-1])
        assert torch.allclose(rows, full[-len(e):], atol=1e-4)
        assert torch.equal(rows.argmax(-1), full[-len(e):].argmax(-1))


@torch.inference_mode()
def test_pages_are_taken_as_needed_and_given_back(model):
    pool = KVPool(model, tokens=64, page_size=4)  # 16 pages
    a, b = pool.sequence(), pool.sequence()
    a.forward(TOKENS, 1)  # 8 tokens: 2 pages
    b.forward(TOKENS[:5], 1)  # 5 tokens: 2 pages
    assert pool.used_pages == 4 and not set(a.pages) & set(b.pages)  # no page shared by two live sequences
    a.rollback(5)  # 5 tokens still need 2 pages
    assert pool.used_pages == 4
    a.rollback(4)
    assert pool.used_pages == 3 and len(a.pages) == 1
    out = a.forward([77, 78], 2)  # continues exactly after a mid-page rollback
    assert torch.allclose(out, _full_logits(model, TOKENS[:4] + [77, 78])[-2:], atol=1e-4)
    a.close()
    b.close()
    assert pool.used_pages == 0 and pool.free_pages == 16


@torch.inference_mode()
def test_a_full_pool_refuses_and_changes_nothing(model):
    pool = KVPool(model, tokens=16, page_size=4)  # 4 pages
    a, b = pool.sequence(), pool.sequence()
    a.forward(TOKENS, 1)
    with pytest.raises(PoolFull, match="free pages"):
        pool.forward([(b, TOKENS, 1), (a, [1, 2, 3, 4, 5], 1)])
    assert len(b) == 0 and len(a) == len(TOKENS) and pool.used_pages == 2
    assert pool.nbytes == 2 * sum(k.nbytes for k in pool.keys) and pool.tokens == 16


@torch.inference_mode()
def test_the_models_own_attention_is_back_after_a_pooled_forward(model):
    pool = KVPool(model, tokens=64)
    before = model.config._attn_implementation
    pool.sequence().forward(TOKENS, 1)
    assert model.config._attn_implementation == before
    generated = model.generate(torch.tensor([TOKENS]), max_new_tokens=3, do_sample=False, eos_token_id=None)
    assert generated.shape == (1, len(TOKENS) + 3)


@torch.inference_mode()
def test_no_page_is_ever_held_by_two_live_sequences(model):
    """Random ragged forwards, rollbacks and closes over a small pool: after every step the live
    sequences' pages are disjoint, and used + free pages are the whole pool."""
    import random

    rng = random.Random(0)
    pool = KVPool(model, tokens=96, page_size=4)  # 24 pages
    live = [pool.sequence() for _ in range(4)]
    for _ in range(150):
        op = rng.random()
        seq = rng.choice(live)
        if op < 0.55:
            steps = [(s, [rng.randrange(1, 200) for _ in range(rng.randint(1, 6))], 1) for s in rng.sample(live, 2)]
            try:
                pool.forward(steps)
            except PoolFull:
                pass
        elif op < 0.85:
            seq.rollback(rng.randint(0, len(seq)))
        else:
            seq.close()
            live[live.index(seq)] = pool.sequence()
        held = [p for s in live for p in s.pages]
        assert len(held) == len(set(held)), "a page is held by two live sequences"
        assert pool.used_pages == len(held) and pool.used_pages + pool.free_pages == 24
    for s in live:
        s.close()
    assert pool.used_pages == 0


@torch.inference_mode()
def test_a_fork_shares_its_pages_and_copies_the_one_it_writes_into(model):
    pool = KVPool(model, tokens=64, page_size=4)  # 16 pages
    a = pool.sequence()
    a.forward(TOKENS[:6], 1)  # 6 tokens: 2 pages, the second half full
    b = a.fork()
    assert b.pages == a.pages and b.tokens == a.tokens and pool.used_pages == 2  # nothing copied
    assert b.pages_needed(1) == 1  # its next token goes into a shared page: copied first
    b.rollback_to_prefix_of(TOKENS[:5] + [91, 92])
    out_b = b.forward([91, 92, 93], 3)
    assert pool.used_pages == 3 and b.pages[0] == a.pages[0] and b.pages[1] != a.pages[1]  # page 2 copied
    out_a = a.forward(TOKENS[6:], 2)  # a's own pages were never written by b
    assert torch.allclose(out_a, _full_logits(model, TOKENS)[-2:], atol=1e-4)
    assert torch.allclose(out_b, _full_logits(model, TOKENS[:5] + [91, 92, 93])[-3:], atol=1e-4)
    a.close()
    assert pool.used_pages == 2  # the shared first page stays with b
    assert torch.allclose(b.forward([94], 1), _full_logits(model, TOKENS[:5] + [91, 92, 93, 94])[-1:], atol=1e-4)
    b.close()
    assert pool.used_pages == 0 and pool.free_pages == 16


@torch.inference_mode()
def test_a_fork_on_a_page_boundary_copies_nothing(model):
    pool = KVPool(model, tokens=64, page_size=4)
    a = pool.sequence()
    a.forward(TOKENS, 1)  # two full pages
    b = a.fork()
    assert b.pages_needed(1) == 1 and a.pages_needed(1) == 1  # a new page each, no copy
    pool.forward([(a, [70], 1), (b, [71], 1)])
    assert pool.used_pages == 4 and a.pages[:2] == b.pages[:2]
    a.close()
    b.close()
    assert pool.used_pages == 0


@torch.inference_mode()
def test_a_full_pool_refuses_a_forks_copy_and_changes_nothing(model):
    pool = KVPool(model, tokens=8, page_size=4)  # 2 pages
    a = pool.sequence()
    a.forward(TOKENS[:6], 1)
    b = a.fork()
    with pytest.raises(PoolFull, match="free pages"):
        b.forward([50], 1)
    assert len(b) == 6 and b.pages == a.pages and pool.used_pages == 2


@torch.inference_mode()
def test_forks_keep_every_page_counted_once_and_every_sequence_its_own_tokens(model):
    """Random forks, ragged forwards, rollbacks and closes over a small pool: every live
    sequence's next logits equal its tokens' forward from scratch, pages shared by forks are
    counted once, and every page comes back when the last holder closes."""
    import random

    rng = random.Random(1)
    pool = KVPool(model, tokens=128, page_size=4)  # 32 pages
    live = [pool.sequence()]
    pool.forward([(live[0], TOKENS, 1)])
    for _ in range(80):
        op, seq = rng.random(), rng.choice(live)
        if op < 0.3 and len(live) < 5:
            live.append(seq.fork())
        elif op < 0.7:
            steps = [(s, [rng.randrange(1, 200) for _ in range(rng.randint(1, 5))], 1)
                     for s in rng.sample(live, min(2, len(live)))]
            try:
                rows = pool.forward(steps)
            except PoolFull:
                continue
            for (s, _, _), row in zip(steps, rows):
                assert torch.allclose(row, _full_logits(model, s.tokens)[-1:], atol=1e-4)
        elif op < 0.9:
            seq.rollback(rng.randint(1, len(seq)))
        elif len(live) > 1:
            seq.close()
            live.remove(seq)
        held = {p for s in live for p in s.pages}
        assert pool.used_pages == len(held) and pool.used_pages + pool.free_pages == 32
    for s in live:
        s.close()
    assert pool.used_pages == 0 and pool.free_pages == 32


def test_the_pools_memory_is_what_the_setting_says(model):
    """--kv-cache-tokens N: keys and values for N tokens (whole pages) in every layer, allocated
    once; nothing grows with the sessions."""
    config = model.config
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pool = KVPool(model, tokens=1000, page_size=16)  # 63 pages: 1008 tokens
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize
    assert pool.tokens == 1008 and pool.nbytes == 1008 * per_token
    seqs = [pool.sequence() for _ in range(3)]
    pool.forward([(s, TOKENS, 1) for s in seqs])
    assert pool.nbytes == 1008 * per_token


# --- attention planned once per forward: bitwise what a per-sequence gather gives -------------

from transformers import AttentionInterface  # noqa: E402

from svip_common import kv_cache  # noqa: E402


def _per_sequence_gather(steps):
    """The attention as first written, the reference: per layer and per sequence, a gather of its
    every key and value by its page table and a causal mask built there."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        meta = kwargs["svip_ragged"]
        keys, values = meta.pool.keys[module.layer_idx], meta.pool.values[module.layer_idx]
        outs, start = [], 0
        for seq, new, _ in steps:
            n = len(new)
            q = query[:, :, start : start + n]
            start += n
            slots = seq._slots_upto(len(seq) + n)
            k = keys[slots].permute(1, 0, 2).unsqueeze(0)
            v = values[slots].permute(1, 0, 2).unsqueeze(0)
            total = slots.shape[0]
            mask = None if n == 1 else torch.ones(n, total, dtype=torch.bool).tril(total - n)
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True))
        return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None

    return attention


def _forward_twice(pool, steps):
    """The step's logits with the pool's attention (through its flat decoder) and with the
    reference (through the model's own modules), from the same cache."""
    lengths = [len(seq) for seq, _, _ in steps]
    assert pool.decoder is not None  # the test model's layout is one the decoder knows
    planned = pool.forward(steps)
    for (seq, _, _), n in zip(steps, lengths):
        seq.rollback(n)
    decoder, pool.decoder = pool.decoder, None  # the modules, which reach the registered attention
    AttentionInterface.register(kv_cache.ATTENTION, _per_sequence_gather(steps))
    try:
        reference = pool.forward(steps)
    finally:
        AttentionInterface.register(kv_cache.ATTENTION, kv_cache._ragged_attention_forward)
        pool.decoder = decoder
    return planned, reference


def _mixed_pool(model):
    """A pool holding one run, two scattered sequences (one rolled back mid-page) and room for a
    new run; returns the pool and those three sequences."""
    pool = KVPool(model, tokens=128, page_size=4)  # 32 pages
    alone = pool.sequence()
    alone.forward(TOKENS + [3, 4, 5], 1)  # one run of pages
    fillers = [pool.sequence() for _ in range(pool.free_pages)]
    pool.forward([(f, [1], 1) for f in fillers])  # every page held
    for f in fillers[::3]:
        f.close()  # holes of one page: what grows now is scattered
    a, b = pool.sequence(), pool.sequence()
    for i in range(3):
        pool.forward([(a, [10 + i, 11 + i, 12 + i], 1), (b, [20 + i, 21 + i, 22 + i], 1)])
    a.rollback(5)  # mid-page, pages freed and taken again
    pool.forward([(a, [1, 2, 3, 4], 1)])
    for f in fillers[1::3] + fillers[2::3]:
        f.close()  # room again: a new sequence is one run
    return pool, alone, a, b


def _plan(pool, steps):
    for seq, new, _ in steps:  # pages grown ahead (the forward would), so the plan can be read here
        seq._grow(len(new))
    return kv_cache._Ragged.plan(pool, [(seq, len(new)) for seq, new, _ in steps])


@torch.inference_mode()
def test_planned_attention_is_bitwise_a_per_sequence_gather(model, monkeypatch):
    """Sequences attended one by one (views of one run, rows of the step's single gather, masks
    made once, a prefill from nothing by is_causal): the logits equal, bit for bit, those of the
    per-sequence gathers they replace, for decode and verify rows and the prefill."""
    monkeypatch.setattr(kv_cache, "PACK_MAX_NEW", 0)  # nothing packed: every item on its own
    pool, alone, a, b = _mixed_pool(model)
    steps = [(alone, [7], 1), (a, [8, 9, 10, 11], 4), (b, [12], 1), (pool.sequence(), TOKENS, 3)]
    planned_meta = _plan(pool, steps)
    assert not planned_meta.packs and [it.run for it in planned_meta.items] == [True, False, False, True]
    assert [it.causal for it in planned_meta.items] == [False, False, False, True]  # the prefill: is_causal
    planned, reference = _forward_twice(pool, steps)
    for p, r in zip(planned, reference, strict=True):
        assert torch.equal(p, r)


@pytest.mark.parametrize("shape", ["decode", "verify", "with-a-prefill-chunk-first", "equal-lengths"])
@torch.inference_mode()
def test_packed_attention_equals_a_per_sequence_gather(model, monkeypatch, shape):
    """The step's short items in one padded SDPA call per layer (keys gathered and masked to each
    item's own, queries padded to the widest): the logits those items get attended one by one,
    to float32 rounding, with the same argmax; a long item (a prefill chunk) stays on its own."""
    monkeypatch.setattr(kv_cache, "PACK_MAX_NEW", 4)
    pool, alone, a, b = _mixed_pool(model)
    if shape == "decode":
        steps = [(alone, [7], 1), (a, [8], 1), (b, [12], 1)]
    elif shape == "verify":
        # the second, 3 tokens beside 13, too short to pad to the others: on its own
        steps = [(alone, [7, 8], 2), (pool.sequence(), [3, 4, 5], 3), (a, [8, 9, 10, 11], 4), (b, [12], 1)]
    elif shape == "with-a-prefill-chunk-first":
        steps = [(pool.sequence(), TOKENS, 0), (alone, [7], 1), (a, [8, 9, 10], 3), (b, [12], 1)]
    else:
        b.rollback(len(a))
        steps = [(a, [8], 1), (b, [9], 1)]
    meta = _plan(pool, steps)
    assert len(meta.packs) == 1 and meta.packs[0].items + len(meta.items) == len(steps)
    assert (meta.packs[0].mask is None) == (shape == "equal-lengths")
    assert (meta.order is None) == (shape in ("decode", "equal-lengths"))
    planned, reference = _forward_twice(pool, steps)
    for p, r in zip(planned, reference, strict=True):
        assert p.shape == r.shape
        assert torch.allclose(p, r, atol=1e-4)
        assert torch.equal(p.argmax(-1), r.argmax(-1))


@torch.inference_mode()
def test_sequences_growing_side_by_side_stay_runs_while_the_pool_has_room(model):
    """Prefilled together and decoded together, with rollbacks, each sequence keeps one run of
    pages (its keys a view); when the pool is too full for that, pages still come, scattered."""
    pool = KVPool(model, tokens=64 * 4, page_size=4)  # 64 pages
    seqs = [pool.sequence() for _ in range(4)]
    pool.forward([(s, TOKENS[: 3 + i], 1) for i, s in enumerate(seqs)])
    for step in range(30):
        pool.forward([(s, [1 + step % 7], 1) for s in seqs])
        if step % 5 == 4:
            seqs[step % 4].rollback(len(seqs[step % 4]) - 6)
    for s in seqs:
        assert s.pages == list(range(s.pages[0], s.pages[0] + len(s.pages))), s.pages
    assert len({p for s in seqs for p in s.pages}) == sum(len(s.pages) for s in seqs)
    late = pool.sequence()
    late.forward([5] * (pool.free_pages * 4), 1)  # every page left, wherever they are
    assert pool.free_pages == 0 and len(late.pages) * 4 == len(late)


def test_packs_bound_their_padding():
    """Short items are packed while the gathered [items, longest] is at most twice the keys they
    hold and PACK_MAX_SLOTS; each group keeps the step's order; a group of one goes alone."""
    def item(start, total):
        return (None, None, start, 1, total)

    def starts(groups):
        return [[it[2] for it in g] for g in groups]

    groups, alone = kv_cache._pack_groups([item(0, 100), item(1, 40), item(2, 60), item(3, 50), item(4, 200)])
    assert starts(groups) == [[0, 4], [1, 2, 3]] and alone == []
    groups, alone = kv_cache._pack_groups([item(0, 100), item(1, 20), item(2, 60), item(3, 50), item(4, 200)])
    assert starts(groups) == [[0, 4], [2, 3]] and [it[2] for it in alone] == [1]
    groups, alone = kv_cache._pack_groups([item(0, 10), item(1, 1000)])
    assert groups == [] and sorted(it[2] for it in alone) == [0, 1]
    groups, alone = kv_cache._pack_groups([item(i, kv_cache.PACK_MAX_SLOTS // 4) for i in range(10)])
    assert starts(groups) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and alone == []


@pytest.mark.parametrize("seed", range(4))
@torch.inference_mode()
def test_random_ragged_steps_pack_to_what_each_sequence_gets_alone(model, monkeypatch, seed):
    """Random steps over sequences of random lengths (some rolled back mid-page, new ones joining,
    prefill chunks among decode and verify rows), with a slot cap that splits the packs into
    several groups: every row's logits equal the per-sequence gather's to float rounding, with the
    same argmax."""
    monkeypatch.setattr(kv_cache, "PACK_MAX_SLOTS", 64)
    plan, packs = kv_cache._Ragged.plan, []

    def counted(pool, steps, inputs=()):
        meta = plan(pool, steps, inputs)
        packs.append(len(meta.packs))
        return meta

    monkeypatch.setattr(kv_cache._Ragged, "plan", staticmethod(counted))
    g = torch.Generator().manual_seed(seed)

    def rand(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    pool = KVPool(model, tokens=1024, page_size=4)
    seqs = [pool.sequence() for _ in range(6)]
    pool.forward([(s, [rand(1, 90) for _ in range(rand(1, 30))], 1) for s in seqs])
    for _ in range(4):
        for s in seqs:
            if rand(0, 3) == 0 and len(s) > 2:
                s.rollback(rand(1, len(s)))
        if rand(0, 2) == 0:
            seqs.append(pool.sequence())
        steps = []
        for s in seqs:
            n = rand(1, 40) if len(s) == 0 or rand(0, 5) == 0 else rand(1, 6)
            steps.append((s, [rand(1, 90) for _ in range(n)], rand(0, n + 1) if n > 1 else 1))
        planned, reference = _forward_twice(pool, steps)
        for p, r in zip(planned, reference, strict=True):
            assert p.shape == r.shape
            if p.numel():
                assert torch.allclose(p, r, atol=1e-4) and torch.equal(p.argmax(-1), r.argmax(-1))
        for s in seqs:  # one more token each, one at a time
            s.forward([rand(1, 90)], 1)
    assert max(packs) >= 2  # the slot cap split a step's short items into several packed calls


# --- a step's index inputs in one persistent buffer, one copy to the device -------------------------


@torch.inference_mode()
def test_a_steps_index_tensors_are_views_of_one_buffer_that_persists(model, monkeypatch):
    """Every index tensor a forward's plan hands the model and its attention (ids, positions,
    kept rows, write slots, the gather, the order, the packs' layouts) is a view of the pool's one
    staging buffer, holding the values it was planned with; the buffer is the same from step to
    step and grows only when a step needs more. (Staged on the host here, as on a device: on a
    CPU the pool skips it, there being nothing to copy; the logits are the same either way.)"""
    monkeypatch.setattr(kv_cache, "PACK_MAX_NEW", 2)  # the two decode rows packed, the others alone
    pool, alone, a, b = _mixed_pool(model)
    pool.staging = kv_cache.StepBuffer(pool.device, through_buffer=True)
    steps = [(alone, [7], 1), (a, [8, 9, 10, 11], 4), (b, [12], 1), (pool.sequence(), TOKENS, 3)]
    for seq, new, _ in steps:
        seq._grow(len(new))
    ids = [t for _, new, _ in steps for t in new]
    meta = kv_cache._Ragged.plan(pool, [(seq, len(new)) for seq, new, _ in steps], inputs=(ids, [3, 4]))
    staged = [*meta.inputs, meta.write_slots, meta.gather, meta.order]
    staged += [t for p in meta.packs for t in (p.slots, p.queries, p.seen, p.rows) if t is not None]
    buffer = pool.staging._device.untyped_storage().data_ptr()
    assert meta.packs and meta.gather is not None and meta.order is not None
    assert all(t.untyped_storage().data_ptr() == buffer for t in staged)
    assert meta.inputs[0].tolist() == ids and meta.inputs[1].tolist() == [3, 4]
    writes = [seq._slots_upto(len(seq) + len(new))[-len(new):] for seq, new, _ in steps]
    assert meta.write_slots.tolist() == torch.cat(writes).tolist()
    size = pool.staging._host.numel()
    kv_cache._Ragged.plan(pool, [(alone, 1)], inputs=([7], [0]))
    assert pool.staging._device.untyped_storage().data_ptr() == buffer  # a smaller step: the same buffer
    kv_cache._Ragged.plan(pool, [(alone, 1)], inputs=(list(range(3 * size)),))
    assert pool.staging._device.numel() >= 3 * size and pool.staging.copies == 3  # a larger one: grown
    staged = pool.forward(steps)  # through the buffer, then as a CPU pool runs it: the same logits
    for seq, new, _ in steps:
        seq.rollback(len(seq) - len(new))
    pool.staging = kv_cache.StepBuffer(pool.device)
    for s, h in zip(staged, pool.forward(steps), strict=True):
        assert torch.equal(s, h)


def test_a_step_reaches_another_device_in_one_copy():
    """Off the host, the staged parts go over in one transfer into one device buffer, each a view
    of it with its own shape (run on the meta device here: it has no values, but the same code
    path; tests/gpu checks the values on CUDA)."""
    staging = kv_cache.StepBuffer(torch.device("meta"))
    parts = [torch.arange(5), torch.arange(6).view(2, 3), torch.tensor([9])]
    staged = staging.upload(parts)
    assert staging.copies == 1
    assert [t.device.type for t in staged] == ["meta"] * 3 and [t.shape for t in staged] == [p.shape for p in parts]
    assert len({t.untyped_storage().data_ptr() for t in staged}) == 1
    staging.upload(parts)
    assert staging.copies == 2


def _runs_by_scan(free: list[int]) -> dict[int, int]:
    """The maximal runs of a sorted page list, by a scan of every page (the reference)."""
    runs, start, prev = {}, None, None
    for page in free:
        if prev is None or page != prev + 1:
            start = page
        runs[start] = page - start + 1
        prev = page
    return runs


def _roomiest_by_scan(free: list[int]) -> int:
    """Where a new sequence starts, as first written: a scan of every free page."""
    best_start, best_len, start, prev = 0, 0, None, None
    for page in free:
        if prev is None or page != prev + 1:
            start = page
        prev = page
        if page - start + 1 > best_len:
            best_start, best_len = start, page - start + 1
    return best_start if best_start == 0 else best_start + best_len // 2


@pytest.mark.parametrize("seed", range(4))
def test_free_runs_are_kept_as_pages_come_and_go(seed):
    """The free list's runs, kept page by page as sequences take and give pages, are those a scan
    of the free pages finds, and a new sequence starts where the scan would put it."""
    import random

    rng = random.Random(seed)
    free = kv_cache._FreePages(97)
    held: list[list[int]] = []
    for _ in range(400):
        if held and (rng.random() < 0.45 or len(free) < 8):
            pages = held.pop(rng.randrange(len(held)))
            cut = rng.randint(0, len(pages))  # a rollback gives back a tail; a close, everything
            free.give(pages[cut:])
            if cut:
                held.append(pages[:cut])
        elif held and rng.random() < 0.5:
            seq = rng.choice(held)
            seq += free.take(rng.randint(1, min(4, len(free))), seq[-1])
        else:
            assert free._roomiest() == _roomiest_by_scan(free._free)
            held.append(free.take(rng.randint(1, min(6, len(free))), None))
        assert free._free == sorted(set(range(97)) - {p for pages in held for p in pages})
        assert dict(zip(free._starts, (free._lengths[s] for s in free._starts))) == _runs_by_scan(free._free)
        assert free._starts == sorted(free._lengths)
