"""The feature-level draft head (draft_worker/feature_head.py): its checkpoint in the published
EAGLE-3 layout (written by hand here, as a published head is, and by save_head), the checks that
refuse a head that does not fit its target, and its cached forward against a full one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from draft_worker.feature_head import FeatureHead, HeadCache, HeadConfig, load_head, save_head
from svip_common.errors import ModelLoadError


@pytest.fixture()
def target_config():
    """The embedded pair's target (10 layers, 256 wide): its config only."""
    from transformers import AutoConfig

    from svip_assets import default_pair

    return AutoConfig.from_pretrained(default_pair()[0])


def small_config(vocab: int = 64, draft_vocab: int = 32) -> HeadConfig:
    return HeadConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=vocab, draft_vocab_size=draft_vocab, target_layers=(1, 2, 3))


def published_tensors(c: HeadConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A head's tensors by the names a published EAGLE-3 checkpoint uses (not via save_head)."""
    g = torch.Generator().manual_seed(seed)
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.input_layernorm.weight": 1 + w(h),
        "midlayer.hidden_norm.weight": 1 + w(h),
        "midlayer.self_attn.q_proj.weight": w(q, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, q),
        "midlayer.post_attention_layernorm.weight": 1 + w(h),
        "midlayer.mlp.gate_proj.weight": w(c.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": w(c.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": w(h, c.intermediate_size),
        "norm.weight": 1 + w(h),
        "lm_head.weight": w(c.draft_vocab_size, h),
        # the draft vocabulary: every other target id
        "d2t": torch.arange(c.draft_vocab_size) * 2 - torch.arange(c.draft_vocab_size),
        "t2d": torch.arange(c.vocab_size) % 2 == 0,
    }
    return tensors


def write_published(directory, c: HeadConfig, tensors: dict, config_edit=None):
    directory.mkdir(parents=True, exist_ok=True)
    raw = c.to_dict()
    if config_edit:
        config_edit(raw)
    (directory / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


class _Config:
    def __init__(self, hidden=32, vocab=64, layers=4):
        self.hidden_size, self.vocab_size, self.num_hidden_layers = hidden, vocab, layers


def test_a_head_in_the_published_layout_loads_and_drafts(tmp_path):
    c = small_config()
    tensors = published_tensors(c)
    head = load_head(write_published(tmp_path / "head", c, tensors), _Config())
    assert torch.equal(head.fc.weight, tensors["fc.weight"]) and head.t2d.dtype == torch.bool
    assert head.target_ids(torch.tensor([0, 1, 5])).tolist() == [0, 2, 10]  # d2t offsets
    hidden = tuple(torch.randn(6, 32) for _ in range(5))  # a target's hidden states at 6 positions
    feats = head.fuse(hidden)
    out = head(torch.randn(6, 32), feats, HeadCache())
    assert out.shape == (6, 32) and head.logits(out).shape == (6, 32)
    assert torch.isfinite(head.logits(out)).all()


def test_save_head_round_trips(tmp_path):
    c = small_config()
    head = FeatureHead(c)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    loaded = load_head(save_head(head, tmp_path / "saved"), _Config())
    assert loaded.config == c
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    embeds, feats = torch.randn(5, 32), torch.randn(5, 32)
    with torch.no_grad():
        assert torch.equal(head(embeds, feats, HeadCache()), loaded(embeds, feats, HeadCache()))


def test_the_cached_forward_equals_a_full_one():
    """Positions fed in pieces (a prompt, then one at a time, then a rollback and a different
    continuation) give the hidden states a full forward gives."""
    torch.manual_seed(0)
    head = FeatureHead(small_config()).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
        embeds, feats = torch.randn(9, 32), torch.randn(9, 32)
        full = head(embeds, feats, HeadCache())
        cache = HeadCache()
        parts = [head(embeds[:4], feats[:4], cache)]
        parts += [head(embeds[i:i + 1], feats[i:i + 1], cache) for i in range(4, 9)]
        assert torch.allclose(torch.cat(parts), full, atol=1e-5)
        cache.rollback(6)
        other = torch.randn(2, 32)
        again = head(other, feats[6:8], cache)
        reference = head(torch.cat([embeds[:6], other]), feats[:8], HeadCache())[6:]
        assert len(cache) == 8 and torch.allclose(again, reference, atol=1e-5)


def test_one_token_in_many_sequences_at_once_is_each_alone():
    """decode_rows (the batched draft step): row i, and the keys its cache takes, are what the
    cached forward gives that sequence alone, for caches of different lengths (one empty)."""
    torch.manual_seed(1)
    head = FeatureHead(small_config()).eval()
    lengths = [0, 1, 5, 12, 3]
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
        alone, together = [], []
        for n in lengths:
            history = torch.randn(n, 32), torch.randn(n, 32)
            a, b = HeadCache(), HeadCache()
            if n:
                head(*history, a), head(*history, b)
            alone.append(a), together.append(b)
        embeds, feats = torch.randn(len(lengths), 32), torch.randn(len(lengths), 32)
        one_by_one = torch.cat([head(embeds[i : i + 1], feats[i : i + 1], c) for i, c in enumerate(alone)])
        rows = head.decode_rows(embeds, feats, together)
    assert rows.shape == one_by_one.shape and torch.allclose(rows, one_by_one, atol=1e-5)
    assert torch.equal(head.logits(rows).argmax(-1), head.logits(one_by_one).argmax(-1))
    for a, b, n in zip(alone, together, lengths):
        assert len(a) == len(b) == n + 1 and torch.allclose(a.keys, b.keys, atol=1e-5)
        assert torch.allclose(a.values, b.values, atol=1e-5)


def test_alternatives_beside_one_another_are_each_alone_and_leave_the_cache_as_it_was():
    """beside (a deep tree's siblings at one place): row i is what the cached forward gives pair i
    alone after the same history, none attends another, and the cache keeps its length and keys."""
    torch.manual_seed(2)
    head = FeatureHead(small_config()).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
        history = torch.randn(7, 32), torch.randn(7, 32)
        cache = HeadCache()
        head(*history, cache)
        keys = cache.keys.clone()
        embeds, feats = torch.randn(4, 32), torch.randn(1, 32).expand(4, -1)
        alone = []
        for i in range(4):
            alone.append(head(embeds[i : i + 1], feats[i : i + 1], cache))
            cache.rollback(7)
        rows = head.beside(embeds, feats, cache)
    assert torch.allclose(rows, torch.cat(alone), atol=1e-5)
    assert torch.equal(head.logits(rows).argmax(-1), head.logits(torch.cat(alone)).argmax(-1))
    assert len(cache) == 7 and torch.equal(cache.keys, keys)


def test_a_head_for_the_embedded_target_fits_it(tmp_path, target_config):
    c = HeadConfig.for_target(target_config)
    assert c.hidden_size == target_config.hidden_size and c.vocab_size == target_config.vocab_size
    assert c.target_layers == (2, 5, 9) and all(0 <= i <= target_config.num_hidden_layers for i in c.target_layers)
    load_head(save_head(FeatureHead(c), tmp_path / "h"), target_config)


@pytest.mark.parametrize("case, message", [
    ("hidden", "the head's hidden size is 32, the target's 48"),
    ("vocab", "the head maps to a vocabulary of 64, the target has 80"),
    ("layers", "the head fuses target layers [1, 2, 3], the target has hidden states 0..2"),
    ("missing", "the checkpoint lacks midlayer.mlp.up_proj.weight"),
    ("shape", "fc.weight has shape [32, 64], the config says [32, 96]"),
    ("d2t", "d2t maps a draft id outside the target's vocabulary of 64"),
    ("two-layers", "eagle_config.eagle_aux_hidden_state_layer_ids must name three target layers"),
    ("no-hidden", "config.json has no 'hidden_size'"),
    ("no-weights", "no model.safetensors or pytorch_model.bin there"),
])
def test_a_head_that_does_not_fit_is_refused_in_one_line(tmp_path, case, message):
    c = small_config()
    tensors = published_tensors(c)
    target, edit = _Config(), None
    if case == "hidden":
        target = _Config(hidden=48)
    elif case == "vocab":
        target = _Config(vocab=80)
    elif case == "layers":
        target = _Config(layers=2)
    elif case == "missing":
        del tensors["midlayer.mlp.up_proj.weight"]
    elif case == "shape":
        tensors["fc.weight"] = torch.zeros(32, 64)
    elif case == "d2t":
        tensors["d2t"] = tensors["d2t"] + 100
    elif case == "two-layers":  # (none at all is EAGLE-3's default: tests/integration/test_hub_heads.py)
        def edit(raw):
            raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2]
    elif case == "no-hidden":
        def edit(raw):
            del raw["hidden_size"]
    directory = write_published(tmp_path / case, c, tensors, edit)
    if case == "no-weights":
        (directory / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as err:
        load_head(directory, target)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_training_two_steps_is_what_drafting_sees():
    """The training pass's second step at position p (the head's own output at p - 1 beside the
    embedding two tokens on) equals drafting it: the committed pairs 0..p-1 cached, then the
    head's own pair at p; the first step equals the plain forward."""
    torch.manual_seed(1)
    head = FeatureHead(small_config()).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
        embeds, feats, nxt = torch.randn(2, 7, 32), torch.randn(2, 7, 32), torch.randn(2, 6, 32)
        h1, h2 = head.two_steps(embeds, feats, nxt)
        assert h1.shape == (2, 7, 32) and h2.shape == (2, 6, 32)
        for b in range(2):
            assert torch.allclose(h1[b], head(embeds[b], feats[b], HeadCache()), atol=1e-5)
            for p in (1, 3, 6):
                cache = HeadCache()
                head(embeds[b, :p], feats[b, :p], cache)  # the committed pairs 0..p-1
                drafted = head(nxt[b, p - 1 : p], h1[b, p - 1 : p], cache)  # its own pair at p
                assert torch.allclose(h2[b, p - 1], drafted[0], atol=1e-5), (b, p)


def test_a_prefill_from_nothing_attends_by_is_causal_bit_for_bit_as_the_mask_did(monkeypatch):
    """Several positions with nothing cached (a session's first pass, training's first step) go to
    SDPA with is_causal and no mask (flash on CUDA); after cached keys, a lower-right mask as
    before. On the CPU the hidden states equal, bit for bit, those of the mask it replaced."""
    from draft_worker import feature_head

    torch.manual_seed(2)
    head = FeatureHead(small_config()).eval()
    real, calls = feature_head.grouped_sdpa, []

    def recorded(q, k, v, mask=None, causal=False, **kw):
        calls.append("causal" if causal else "mask" if mask is not None else "none")
        return real(q, k, v, mask, causal=causal, **kw)

    def masked(q, k, v, mask=None, causal=False, **kw):  # what the head did before
        if causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        return real(q, k, v, mask, **kw)

    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
        embeds, feats, nxt = torch.randn(2, 12, 32), torch.randn(2, 12, 32), torch.randn(2, 11, 32)
        monkeypatch.setattr(feature_head, "grouped_sdpa", recorded)
        cache = HeadCache()
        prefill = head(embeds[0, :9], feats[0, :9], cache)
        head(embeds[0, 9:11], feats[0, 9:11], cache)
        head(embeds[0, 11:], feats[0, 11:], cache)
        steps = head.two_steps(embeds, feats, nxt)
        assert calls == ["causal", "mask", "none", "causal", "mask"]
        monkeypatch.setattr(feature_head, "grouped_sdpa", masked)
        assert torch.equal(prefill, head(embeds[0, :9], feats[0, :9], HeadCache()))
        for new, old in zip(steps, head.two_steps(embeds, feats, nxt)):
            assert torch.equal(new, old)
