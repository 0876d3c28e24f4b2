"""Attention with grouped keys and values (GQA: fewer key/value heads than query heads), on the
kernel each device runs fast.

``scaled_dot_product_attention(..., enable_gqa=True)`` is the one call on a CPU: its flash kernel
takes grouped heads and a mask, and its results are the engine's bitwise reference. On CUDA,
enable_gqa reaches only the flash kernel, which takes neither a mask nor float32: a masked call
(a verify step, a packed batch) or a float32 one falls back to the math kernel, which builds every
score in memory (transformers' ``use_gqa_in_sdpa`` avoids the combination for this reason). There
the keys and values are expanded to every query head (``repeat_interleave``, enable_gqa's own
head order) and the call made without it, which the memory-efficient and cuDNN kernels take.
Imports: torch only.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

HALF = (torch.float16, torch.bfloat16)


def grouped_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None = None,
                 scale: float | None = None, expand: bool | None = None, causal: bool = False) -> torch.Tensor:
    """query [..., heads, n, d] over key and value [..., kv_heads, L, d] (heads a multiple of
    kv_heads). expand: heads expanded before the call (None: where the device needs it, see above).
    causal: query i sees keys 0..i, with n == L and no mask (a prefill from nothing)."""
    if causal and (mask is not None or query.shape[-2] != key.shape[-2]):
        raise ValueError("a causal call takes no mask and as many queries as keys")
    if expand is None:
        expand = expands(query, mask)
    groups = query.shape[-3] // key.shape[-3]
    if not expand or groups == 1:
        return scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, is_causal=causal,
                                            enable_gqa=groups > 1)
    key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    return scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, is_causal=causal)


def expands(query: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether grouped heads are expanded for this call: off a CPU, where a mask or float32 would
    take enable_gqa to the math kernel."""
    return query.device.type != "cpu" and (mask is not None or query.dtype not in HALF)
