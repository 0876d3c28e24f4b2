"""Grouped-query attention (svip_common/attention.py): expanding the key/value heads, as a CUDA
call does, gives what enable_gqa gives; a CPU keeps enable_gqa (the engine's bitwise reference)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from svip_common.attention import expands, grouped_sdpa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_expanded_heads_give_what_enable_gqa_gives(dtype, masked):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 5, 16, generator=g).to(dtype)  # items, heads, new tokens, head_dim
    k, v = (torch.randn(3, 2, 40, 16, generator=g).to(dtype) for _ in range(2))  # four query heads per kv head
    mask = torch.ones(3, 1, 5, 40, dtype=torch.bool).tril(35) if masked else None
    mask = None if mask is None else mask & (torch.arange(40) < torch.tensor([40, 33, 20])[:, None, None, None])
    grouped = grouped_sdpa(q, k, v, mask, 0.25, expand=False)
    expanded = grouped_sdpa(q, k, v, mask, 0.25, expand=True)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(grouped.float(), expanded.float(), atol=tol)
    # and the head order is enable_gqa's: query head h reads kv head h // 4
    alone = torch.nn.functional.scaled_dot_product_attention(
        q[:, 4:5], k[:, 1:2], v[:, 1:2], attn_mask=mask, scale=0.25)
    assert torch.allclose(expanded[:, 4:5].float(), alone.float(), atol=tol)


def test_a_cpu_keeps_enable_gqa_and_a_gpu_call_expands_where_it_would_hit_the_math_kernel():
    q = torch.zeros(1, 8, 2, 16)
    assert not expands(q, None) and not expands(q, torch.ones(1, 1, 2, 4, dtype=torch.bool))
    meta = q.to("meta")
    assert expands(meta, None)  # float32: no flash kernel
    assert not expands(meta.to(torch.bfloat16), None)  # half precision, no mask: flash takes grouped heads
    assert expands(meta.to(torch.bfloat16), torch.ones(1, 1, 2, 4, dtype=torch.bool, device="meta"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        grouped_sdpa(q, torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16), torch.ones(1, 1, 2, 4, dtype=torch.bool))
    assert not any("repeat_interleave" in e.name for e in prof.events())  # nothing copied on a CPU


@pytest.mark.parametrize("n", [2, 7, 33, 200])
@pytest.mark.parametrize("kv_heads", [2, 8])
def test_a_causal_call_is_bitwise_the_masked_one_on_a_cpu(n, kv_heads):
    """A prefill from nothing takes is_causal instead of a lower-triangular mask: the same bits."""
    g = torch.Generator().manual_seed(n)
    q = torch.randn(1, 8, n, 16, generator=g)
    k, v = (torch.randn(1, kv_heads, n, 16, generator=g) for _ in range(2))
    masked = grouped_sdpa(q, k, v, torch.ones(n, n, dtype=torch.bool).tril(), 0.25)
    assert torch.equal(grouped_sdpa(q, k, v, None, 0.25, causal=True), masked)


def test_a_causal_call_takes_no_mask_and_as_many_queries_as_keys():
    q, kv = torch.zeros(1, 8, 3, 16), torch.zeros(1, 2, 5, 16)
    with pytest.raises(ValueError, match="as many queries as keys"):
        grouped_sdpa(q, kv, kv, causal=True)  # queries after cached keys need the lower-right mask
    with pytest.raises(ValueError, match="no mask"):
        grouped_sdpa(q[:, :, :3], kv[:, :, :3], kv[:, :, :3], torch.ones(3, 3, dtype=torch.bool), causal=True)
