"""The pool's flat decoder (svip_common/pool_decoder.py): bitwise the model's own modules on a CPU
(logits and hidden states, prefill chunks, ragged decode and verify steps, after rollbacks), for
the layouts it knows; everything else goes through the modules."""

from __future__ import annotations

import random

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from svip_common.kv_cache import KVPool
from svip_common.pool_decoder import PoolDecoder


def _small(config_class, model_class, seed: int = 0, **extra):
    config = config_class(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          initializer_range=0.5, tie_word_embeddings=False, **extra)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # biases, where the layout has them, away from zero so a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def _two_pools(model):
    flat, modules = KVPool(model, tokens=1024, page_size=8), KVPool(model, tokens=1024, page_size=8, flat=False)
    assert flat.decoder is not None and modules.decoder is None
    return flat, modules


def _replay(model, seed: int, layers=()):
    """The same random ragged steps (prefill chunks, decode and verify rows, rollbacks) on a pool
    run through the decoder and one through the modules; asserts every output bitwise equal."""
    rng = random.Random(seed)
    pools = _two_pools(model)
    seqs = [[pool.sequence() for _ in range(4)] for pool in pools]
    for step in range(12):
        chosen = rng.sample(range(4), rng.randint(1, 4))
        new = [[rng.randrange(1, 300) for _ in range(rng.choice((1, 2, 5, 40)))] for _ in chosen]
        keep = [rng.randint(0, len(ids)) for ids in new]
        outs = [pool.forward_features([(ss[i], ids, k) for i, ids, k in zip(chosen, new, keep)], layers)
                for pool, ss in zip(pools, seqs)]
        for got, want in zip(outs[0][0] + outs[0][1], outs[1][0] + outs[1][1]):
            assert torch.equal(got, want), f"step {step}: differs by {(got - want).abs().max().item()}"
        if step % 3 == 2:
            i, length = rng.randrange(4), rng.randint(0, 30)
            for ss in seqs:
                ss[i].rollback(length)
    return outs


@torch.inference_mode()
@pytest.mark.parametrize("seed", [0, 1])
def test_the_decoder_is_bitwise_the_models_modules(models, seed):
    for name in ("target", "peaky"):
        _replay(models[name].model, seed)


@torch.inference_mode()
def test_hidden_states_are_bitwise_the_models_at_every_index(models):
    """A feature draft's inputs: 0 the embeddings, i layer i's output, the last one after the norm."""
    model = models["target"].model
    layers = tuple(range(model.config.num_hidden_layers + 1))
    (_, features), _ = _replay(model, 2, layers)
    assert features and all(f.shape[-1] == len(layers) * model.config.hidden_size for f in features)


def test_the_fused_weights_are_the_models_own_not_a_copy(tmp_path):
    """q/k/v and gate/up are made blocks of one tensor once: a second pool finds them so, the
    model's own forward still gives what it gave, the model saves and reloads as it was, and a
    change to a module's weight reaches the pool."""
    model = _small(LlamaConfig, LlamaForCausalLM, seed=5)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits[0]
    attn = model.model.layers[1].self_attn
    pool = KVPool(model, tokens=64)
    fused = pool.decoder.layers[1].qkv
    storage = attn.q_proj.weight.untyped_storage().data_ptr()
    assert {p.weight.untyped_storage().data_ptr() for p in (attn.q_proj, attn.k_proj, attn.v_proj)} == {storage}
    assert fused.untyped_storage().data_ptr() == storage
    assert KVPool(model, tokens=64).decoder.layers[1].qkv.data_ptr() == fused.data_ptr()  # found, not made again
    assert not torch.is_inference(attn.q_proj.weight) and attn.q_proj.weight.requires_grad
    model.save_pretrained(tmp_path)  # parameters sharing one storage still save, one tensor each
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits[0], before)
        assert torch.equal(LlamaForCausalLM.from_pretrained(tmp_path).eval()(input_ids=ids).logits[0], before)
        with torch.no_grad():
            attn.v_proj.weight.mul_(2.0)
        seq = pool.sequence()
        assert torch.equal(seq.forward(ids[0].tolist(), 4), model(input_ids=ids).logits[0])
        assert not torch.equal(seq.forward([9], 1), before[-1:])


@torch.inference_mode()
def test_a_layout_with_biases_qwen2_is_bitwise_its_modules():
    model = _small(Qwen2Config, Qwen2ForCausalLM)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    _replay(model, 3, layers=(0, 2, 3))


@torch.inference_mode()
def test_a_half_precision_model_is_bitwise_its_modules():
    _replay(_small(LlamaConfig, LlamaForCausalLM).to(torch.bfloat16), 4)


@torch.inference_mode()
def test_per_head_norms_qwen3_are_bitwise_its_modules():
    model = _small(Qwen3Config, Qwen3ForCausalLM, head_dim=16)
    assert model.model.layers[0].self_attn.q_norm is not None
    with torch.no_grad():  # the norms' weights away from one, so a dropped or swapped norm shows
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(1, 0.5)
            layer.self_attn.k_norm.weight.normal_(1, 0.5)
    _replay(model, 5, layers=(1, 3))


@torch.inference_mode()
def test_a_layout_the_decoder_does_not_know_goes_through_the_modules():
    """Gemma scales its embeddings and norms by (1 + weight): not Llama's forward, so the pool
    runs the model's own modules."""
    model = _small(GemmaConfig, GemmaForCausalLM, head_dim=16)
    assert PoolDecoder.of(model) is None
    pool = KVPool(model, tokens=256)
    assert pool.decoder is None
    seq = pool.sequence()
    out = seq.forward([5, 6, 7], 3)
    full = model(input_ids=torch.tensor([[5, 6, 7]])).logits[0]
    assert torch.allclose(out, full, atol=1e-5)


def _aten_ops(pool, steps) -> list[str]:
    lengths = [len(seq) for seq, _, _ in steps]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pool.forward(steps)
    for (seq, _, _), n in zip(steps, lengths):
        seq.rollback(n)
    return [e.name for e in prof.events() if e.name.startswith("aten::")]


@torch.inference_mode()
def test_a_layer_is_four_matrix_products_and_far_fewer_operators(models):
    """q/k/v in one product, o, gate/up in one, down: four per layer and the head's, no
    ``nn.Linear`` machinery; a batch-8 verify step runs at most 85% of the modules' operators
    (measured: 81% on the 2-layer test target, 75% on the embedded 10-layer one; the rest is
    attention and the norms' formula, the same on both paths)."""
    model = models["target"].model
    pools = _two_pools(model)
    ops = []
    for pool in pools:
        seqs = [pool.sequence() for _ in range(8)]
        pool.forward([(s, [3 + i] * (10 + i), 1) for i, s in enumerate(seqs)])
        ops.append(_aten_ops(pool, [(s, [7, 8, 9], 3) for s in seqs]))
    flat, modules = ops
    assert flat.count("aten::mm") == 4 * model.config.num_hidden_layers + 1 and "aten::linear" not in flat
    assert modules.count("aten::linear") == 7 * model.config.num_hidden_layers + 1
    assert len(flat) <= 0.85 * len(modules), (len(flat), len(modules))
