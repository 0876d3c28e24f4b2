"""A Llama-family decoder run straight over the KV pool: the operators transformers' modules run,
in their order, on the same weights, without the modules' per-call machinery.

Through transformers, one forward of a 10-layer Llama is ~2,300 aten operators whatever the batch
(each ``nn.Linear`` on a [1, tokens, hidden] input is linear, t, matmul, reshape, mm, view and
their strides; every module call its hooks, output capturing and keyword handling; a causal mask
built and dropped), and on a small model or a GPU that overhead, not the arithmetic, is the step.
Here the step is two-dimensional ([tokens, hidden]) and each projection is one ``mm`` (``addmm``
with a bias) against the weight's transpose, as ``nn.Linear`` itself calls it; q/k/v share one
``mm`` and gate/up another, over their weights concatenated (a column of a GEMM does not depend
on the columns beside it), and q and k are rotated in one pass. The rest is the model's: its
rotary module makes cos and sin, its activation module runs, its RMSNorm's formula is written as
the module writes it, and attention is the pool's (``_Ragged.write`` / ``_Ragged.attend``, as
through the hooks). tests/unit/test_pool_decoder.py checks logits and hidden states bitwise
against the model's own modules.

The concatenation is made once per model and not copied: the modules' parameters become its
blocks (views), so the weights are held once, and the model's own forward, its ``generate`` and
an in-place change to a weight see the same values. A model moved to another device after its
pool was built needs a new pool (as its keys and values do).

Only the layouts this file knows run here (``PoolDecoder.of``: Llama, Mistral, Qwen2 and Qwen3
decoder layers: RMSNorm, a gate/up/down MLP, Qwen3's per-head q/k norms, no sliding window); anything else, or a
model spread over several devices, goes through transformers' modules and the pool's hooks.

A tensor-parallel shard (svip_common/tensor_parallel.py: ``model.svip_tp``) runs here alone: its
embedding and logits through its shard's vocabulary rows, and the o and down projections' partial
products summed over the ranks (an all-reduce each) before their biases and the residual.
Imports: torch only (the pool's plan is passed in; svip_common.kv_cache imports this module).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

# decoder layer classes whose forward is Llama's: norm, attention (q/k/v/o, rotary), residual,
# norm, gate/up/down MLP, residual
KNOWN_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
KNOWN_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
# Qwen3's attention norms each head's q and k (over head_dim) before the rotation
HEAD_NORMS = {"Qwen3DecoderLayer"}
_FUSING = threading.Lock()


@dataclass
class _Layer:
    norm_in: torch.Tensor
    norm_mid: torch.Tensor
    eps_in: float
    eps_mid: float
    qkv: torch.Tensor  # [hidden, q + k + v] (the concatenated weights, transposed)
    qkv_bias: torch.Tensor | None
    split: tuple[int, int, int]
    o: torch.Tensor  # [heads x head_dim, hidden]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [hidden, 2 x intermediate]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    act: torch.nn.Module
    scaling: float
    q_norm: tuple[torch.Tensor, float] | None = None  # (weight, eps) where heads are normed (Qwen3)
    k_norm: tuple[torch.Tensor, float] | None = None


class PoolDecoder:
    """One model's decoder over a pool's plan: ``run(ids, positions, keep, plan, layers)``."""

    def __init__(self, model):
        base = model.model
        self.embed = base.embed_tokens.weight
        self.rotary = base.rotary_emb
        self.norm, self.norm_eps = base.norm.weight, base.norm.variance_epsilon
        self.head = model.lm_head.weight.t()
        self.head_bias = getattr(model.lm_head, "bias", None)
        self.layers = [_layer(layer) for layer in base.layers[: model.config.num_hidden_layers]]
        self.head_dim = base.layers[0].self_attn.head_dim
        self.shard = getattr(model, "svip_tp", None)  # a tensor-parallel rank's place (None: the whole model)
        self._reduce = _identity if self.shard is None else self.shard.group.all_reduce

    @staticmethod
    def of(model) -> PoolDecoder | None:
        """The decoder for a model whose layout this file knows, on one device; else None."""
        if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
            return None
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        if layers is None or not all(hasattr(base, a) for a in ("embed_tokens", "norm", "rotary_emb")):
            return None
        if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
            return None
        if type(base.norm).__name__ not in KNOWN_NORMS or not all(_known(layer) for layer in layers):
            return None
        return PoolDecoder(model)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, plan,
            layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """ids, positions: [tokens]; keep: the rows whose logits are returned ([len(keep), vocab]);
        plan: the pool's ``_Ragged`` for this forward. layers: hidden states to return, indexed as
        transformers' ``hidden_states`` (0 the embeddings, i the output of layer i, the last one
        after the final norm), each [tokens, hidden]."""
        tokens = ids.shape[0]
        shard = self.shard
        hidden = torch.nn.functional.embedding(ids, self.embed) if shard is None else shard.embed(ids, self.embed)
        kept = {0: hidden} if 0 in layers else {}
        cos, sin = self.rotary(hidden, positions[None])  # [1, tokens, head_dim]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # over [1, tokens, heads, head_dim]
        for index, layer in enumerate(self.layers):
            hidden = _block(layer, index, hidden, tokens, self.head_dim, cos, sin, plan, self._reduce)
            if index + 1 in layers and index + 1 < len(self.layers):
                kept[index + 1] = hidden
        hidden = _rms_norm(hidden, self.norm, self.norm_eps)
        if len(self.layers) in layers:
            kept[len(self.layers)] = hidden
        logits = _linear(hidden[keep], self.head, self.head_bias)
        return (logits if shard is None else shard.logits(logits)), kept


def _known(layer) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer).__name__ not in KNOWN_LAYERS or attn is None or mlp is None:
        return False
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if any(type(norm).__name__ not in KNOWN_NORMS for norm in norms):
        return False
    projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    head_norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
    if type(layer).__name__ in HEAD_NORMS:
        if any(type(norm).__name__ not in KNOWN_NORMS for norm in head_norms):
            return False
    elif any(norm is not None for norm in head_norms):
        return False
    if not all(isinstance(p, torch.nn.Linear) for p in projections) or not hasattr(mlp, "act_fn"):
        return False
    biased = [[p.bias is not None for p in group] for group in (projections[:3], projections[4:6])]
    return (all(len(set(group)) == 1 for group in biased)  # fused pairs and triples: all biased or none
            and getattr(attn, "sliding_window", None) is None)  # a windowed layer is not the pool's attention


def _fused(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The linears as one (weight transposed, as ``nn.Linear`` multiplies; bias or None), without
    a copy: the first time, their weights (and biases) are concatenated and each module's
    parameter becomes its block of the result (the model's own forward reads the same values in
    the same layout); afterwards, and for every later pool, that block structure is found and
    viewed whole."""
    weight = _one_tensor([lin.weight for lin in linears])
    biases = [lin.bias for lin in linears]
    return weight.t(), None if biases[0] is None else _one_tensor(biases)


def _one_tensor(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """A tensor whose row blocks are ``params``, which are made its views if they are not already
    (under a lock: two pools built at once on one model fuse its weights once)."""
    with _FUSING:
        return _one_tensor_unlocked(params)


def _one_tensor_unlocked(params: list[torch.nn.Parameter]) -> torch.Tensor:
    first, rows = params[0], sum(p.shape[0] for p in params)
    if _consecutive(params):
        return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
    # made in the mode the parameters were (ordinary ones stay ordinary under a pool made in
    # inference mode)
    with torch.inference_mode(torch.is_inference(first)), torch.no_grad():
        whole = torch.cat([p.detach() for p in params])
        offset = 0
        for p in params:
            p.data = whole[offset : offset + p.shape[0]]
            offset += p.shape[0]
    return whole


def _consecutive(params: list[torch.nn.Parameter]) -> bool:
    """Whether the params are contiguous blocks, one after another, of one storage."""
    storage = params[0].untyped_storage().data_ptr()
    offset = params[0].storage_offset()
    for p in params:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset:
            return False
        offset += p.numel()
    return True


def _layer(layer) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = _fused(attn.q_proj, attn.k_proj, attn.v_proj)
    gate_up, gate_up_bias = _fused(mlp.gate_proj, mlp.up_proj)
    return _Layer(
        norm_in=layer.input_layernorm.weight, norm_mid=layer.post_attention_layernorm.weight,
        eps_in=layer.input_layernorm.variance_epsilon, eps_mid=layer.post_attention_layernorm.variance_epsilon,
        qkv=qkv, qkv_bias=qkv_bias,
        split=(attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features),
        o=attn.o_proj.weight.t(), o_bias=attn.o_proj.bias,
        gate_up=gate_up, gate_up_bias=gate_up_bias,
        down=mlp.down_proj.weight.t(), down_bias=mlp.down_proj.bias,
        act=mlp.act_fn, scaling=attn.scaling,
        q_norm=_norm(getattr(attn, "q_norm", None)), k_norm=_norm(getattr(attn, "k_norm", None)),
    )


def _norm(module) -> tuple[torch.Tensor, float] | None:
    return None if module is None else (module.weight, module.variance_epsilon)


def _block(layer: _Layer, index: int, hidden: torch.Tensor, tokens: int, head_dim: int,
           cos: torch.Tensor, sin: torch.Tensor, plan, reduce=None) -> torch.Tensor:
    """One decoder layer over [tokens, hidden]: attention through the pool's plan, then the MLP;
    reduce: the sum over a tensor-parallel group of a row-parallel projection's partial product."""
    x = _rms_norm(hidden, layer.norm_in, layer.eps_in)
    qkv = _linear(x, layer.qkv, layer.qkv_bias)  # [tokens, q + k + v]
    q_width, k_width, _ = layer.split
    # q and k rotated together (elementwise: each value as the module computes it), then apart
    qk = qkv[:, : q_width + k_width].view(1, tokens, -1, head_dim)
    if layer.q_norm is None:
        q, k = _rotary(qk, cos, sin).split((q_width // head_dim, k_width // head_dim), dim=2)
    else:  # each head normed first, q and k with their own weights
        q, k = qk.split((q_width // head_dim, k_width // head_dim), dim=2)
        q, k = _rotary(_rms_norm(q, *layer.q_norm), cos, sin), _rotary(_rms_norm(k, *layer.k_norm), cos, sin)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [1, heads, tokens, head_dim], as the module's
    v = qkv[:, q_width + k_width :].view(1, tokens, -1, head_dim).transpose(1, 2)
    plan.write(index, k, v)
    attended = plan.attend(index, q, layer.scaling)  # [1, tokens, heads, head_dim]
    reduce = reduce or _identity
    hidden = hidden + _row_parallel(attended.view(tokens, -1), layer.o, layer.o_bias, reduce)
    x = _rms_norm(hidden, layer.norm_mid, layer.eps_mid)
    gate, up = _linear(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
    return hidden + _row_parallel(layer.act(gate) * up, layer.down, layer.down_bias, reduce)


def _row_parallel(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, reduce) -> torch.Tensor:
    """A projection whose input columns a tensor-parallel rank holds a share of: its partial
    product summed over the ranks, then the bias (once); the whole model's ``_linear`` otherwise."""
    if reduce is _identity:
        return _linear(x, weight_t, bias)
    out = reduce(torch.mm(x, weight_t))
    return out if bias is None else out + bias


def _identity(x):
    return x


def _linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight_t (+ bias): the one kernel ``nn.Linear`` reaches on a 2-D input."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, operator for operator (in float32, then back to the input's dtype)."""
    dtype = hidden.dtype
    h = hidden.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)
