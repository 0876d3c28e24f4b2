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
