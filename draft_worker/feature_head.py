"""A feature-level draft head (EAGLE-3's design), and its checkpoint in the published layout.

The head drafts from the target's own hidden states instead of from tokens alone. At a committed
position i it reads g_i, a fusion of three of the target's layers there (a low, a middle and a high
one, concatenated and mapped to the hidden size by ``fc``), together with the embedding of the token
at i + 1 (the target's embedding table: the head has none of its own). One decoder layer
(``midlayer``) turns the pair into a hidden state a_{i+1}, whose ``norm`` and ``lm_head`` give the
next token's distribution over the head's vocabulary, a subset of the target's mapped back through
``d2t``. To draft further, a_{i+1} stands in for the target's fused feature at i + 1 (the head feeds
back its own output) beside the embedding of the token it just chose.

The midlayer is a Llama decoder layer whose attention reads 2 × hidden inputs: the normed embedding
(``input_layernorm``) and the normed feature (``hidden_norm``) side by side; the residual around
the attention is the feature. The head's keys and values for the positions it has seen are kept
per sequence (``HeadCache``): a rejection truncates them like a sequence in the KV pool.

Checkpoint layout (what EAGLE-3's published heads use, and what ``save_head`` writes): a directory
with ``config.json`` (Llama-style: hidden_size, intermediate_size, num_attention_heads,
num_key_value_heads, head_dim, rms_norm_eps, rope_theta, max_position_embeddings, vocab_size (the
target's), draft_vocab_size, and the fused layers under ``eagle_config.eagle_aux_hidden_state_layer_ids``)
and ``model.safetensors`` (or ``pytorch_model.bin``) holding ``fc.weight``, ``midlayer.*``,
``norm.weight``, ``lm_head.weight``, ``d2t`` (draft id → target id offset) and ``t2d`` (which target
ids the head can emit). Everything that does not fit is refused with one line naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.functional import silu

from svip_common.attention import grouped_sdpa
from svip_common.errors import ModelLoadError

WEIGHTS = "model.safetensors"
LEGACY_WEIGHTS = "pytorch_model.bin"


def eagle3_default_layers(target_layer_count: int) -> tuple[int, int, int]:
    """The fused layers EAGLE-3 (and vLLM, SGLang) take when a head's config names none: the inputs
    of the target's third layer, its middle one and its third from last (hidden_states indices)."""
    n = target_layer_count
    return (2, n // 2, n - 3)


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's: the ids d2t maps to
    draft_vocab_size: int  # the head's own LM head
    target_layers: tuple[int, int, int]  # the target's hidden states fused (indices into its hidden_states)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    @staticmethod
    def for_target(target_config, draft_vocab_size: int | None = None, intermediate_size: int | None = None
                   ) -> HeadConfig:
        """A head shaped for a target (a transformers config): its hidden size, heads, rotary base
        and context; the fused layers low (the first), middle and high (the last but one's output)."""
        layers = target_config.num_hidden_layers
        heads = target_config.num_attention_heads
        return HeadConfig(
            hidden_size=target_config.hidden_size,
            intermediate_size=intermediate_size or target_config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            vocab_size=target_config.vocab_size,
            draft_vocab_size=draft_vocab_size or target_config.vocab_size,
            target_layers=(2, layers // 2, layers - 1) if layers >= 4 else (1, max(1, layers // 2), layers),
            rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
            rope_theta=getattr(target_config, "rope_theta", None) or 10000.0,
            max_position_embeddings=getattr(target_config, "max_position_embeddings", 4096),
        )

    @staticmethod
    def from_dict(raw: dict, where: str, target_layer_count: int | None = None) -> HeadConfig:
        """target_layer_count: the target's decoder layers, for a config that names no fused layers
        (SafeAILab's published heads): EAGLE-3's own choice, eagle3_default_layers."""
        try:
            heads = int(raw["num_attention_heads"])
            layers = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            if layers is None and target_layer_count is not None:
                layers = eagle3_default_layers(target_layer_count)
            if layers is None or len(layers) != 3:
                raise ModelLoadError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids must name three "
                                     f"target layers (low, middle, high), got {layers!r}")
            return HeadConfig(
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
                vocab_size=int(raw["vocab_size"]),
                draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
                target_layers=tuple(int(x) for x in layers),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            )
        except KeyError as exc:
            raise ModelLoadError(f"{where}: config.json has no {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{where}: config.json holds a value of the wrong kind ({exc})") from None

    def to_dict(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "num_hidden_layers": 1, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.target_layers)},
        }


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.c = c
        inputs = 2 * c.hidden_size  # the normed embedding and the normed feature, side by side
        self.q_proj = nn.Linear(inputs, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(inputs, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(inputs, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, 2h] at positions [T] (shared) or [B, T] (per sequence) -> q [B, heads, T, d], k
        and v [B, kv_heads, T, d] (q, k rotated)."""
        c, (b, t) = self.c, x.shape[:2]
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = _rotary(positions, c.head_dim, c.rope_theta, x.dtype)
        if positions.dim() == 2:  # [B, T, d] -> [B, 1, T, d]: each sequence its own positions
            cos, sin = cos[:, None], sin[:, None]
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def attend(self, q, k, v, mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
        """[B, heads, T, d] queries over [B, kv_heads, L, d] keys -> [B, T, h]."""
        out = grouped_sdpa(q, k, v, mask, causal=causal)
        return self.o_proj(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: HeadCache) -> torch.Tensor:
        """x [T, 2h] for positions [T] after the ones ``cache`` holds; attends causally: from
        nothing cached, with is_causal and no mask (flash on CUDA); after cached keys, lower-right."""
        q, k, v = self.project(x.unsqueeze(0), positions)
        k, v = cache.extend(k, v)  # [1, kv_heads, L, d], the new ones last
        t, total = x.shape[0], k.shape[2]
        if t == 1 or t == total:
            return self.attend(q, k, v, None, causal=t > 1)[0]
        mask = torch.ones(t, total, dtype=torch.bool, device=x.device).tril(total - t)
        return self.attend(q, k, v, mask)[0]

    def beside(self, x: torch.Tensor, cache: HeadCache) -> torch.Tensor:
        """x [n, 2h]: n alternatives for the one position after what ``cache`` holds, each
        attending the cache and itself, not each other -> [n, h]; the cache is left as it was."""
        n, length = x.shape[0], len(cache)
        q, k, v = self.project(x[None], torch.full((n,), length, device=x.device))
        keys, values = cache.extend(k, v)
        cache.rollback(length)
        mask = torch.cat([torch.ones(n, length, dtype=torch.bool, device=x.device),
                          torch.eye(n, dtype=torch.bool, device=x.device)], dim=1)
        return self.attend(q, keys, values, mask)[0]

    def decode_rows(self, x: torch.Tensor, positions: torch.Tensor, caches: list[HeadCache]) -> torch.Tensor:
        """One new position per sequence: x [B, 2h] at positions [B], each after what its own cache
        holds -> [B, h]. The projections for all at once; each sequence attends its own keys."""
        q, k, v = self.project(x[:, None], positions[:, None])
        out = torch.cat([
            grouped_sdpa(q[i : i + 1], *cache.extend(k[i : i + 1], v[i : i + 1]))
            for i, cache in enumerate(caches)
        ])  # [B, heads, 1, d]
        return self.o_proj(out.reshape(x.shape[0], -1))


class _MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def _inputs(self, embeds, features):
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)

    def _after_attention(self, features, attended):
        h = features + attended
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, embeds, features, positions, cache):
        return self._after_attention(features, self.self_attn(self._inputs(embeds, features), positions, cache))

    def decode_rows(self, embeds, features, positions, caches):
        return self._after_attention(features, self.self_attn.decode_rows(self._inputs(embeds, features), positions,
                                                                          caches))

    def beside(self, embeds, features, cache):
        return self._after_attention(features, self.self_attn.beside(self._inputs(embeds, features), cache))

    def two_steps(self, embeds, features, next_embeds):
        """Training: [B, T, h] pairs (target feature at j, embedding of token j + 1) for positions
        0..T-1 give the first pass's hidden states h1 [B, T, h]; then, at positions 1..T-1, the
        head's own h1 at j with the embedding of token j + 2 (``next_embeds`` [B, T-1, h]) give h2
        [B, T-1, h], each attending to the first pass's keys before its position and to itself:
        what drafting a second token sees (the committed pairs cached, its own pair last)."""
        t, device = embeds.shape[1], embeds.device
        attn = self.self_attn
        q1, k1, v1 = attn.project(self._inputs(embeds, features), torch.arange(t, device=device))
        h1 = self._after_attention(features, attn.attend(q1, k1, v1, None, causal=True))
        own = h1[:, :-1]
        q2, k2, v2 = attn.project(self._inputs(next_embeds, own), torch.arange(1, t, device=device))
        rows = torch.arange(t - 1, device=device)
        seen = torch.cat([torch.arange(t, device=device)[None, :] <= rows[:, None],  # first-pass keys 0..p-1
                          rows[None, :] == rows[:, None]], dim=1)  # and its own
        h2 = self._after_attention(own, attn.attend(q2, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2), seen))
        return h1, h2


class HeadCache:
    """One sequence's keys and values in the head's layer (positions 0 .. len-1), in buffers that
    grow by doubling, so a drafted token appends in place instead of copying the whole history."""

    def __init__(self):
        self._keys: torch.Tensor | None = None  # [1, kv_heads, capacity, d]
        self._values: torch.Tensor | None = None
        self._length = 0

    def __len__(self) -> int:
        return self._length

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, :, : self._length]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[:, :, : self._length]

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append [1, kv_heads, T, d] keys and values; all of them so far, the new ones last."""
        start, end = self._length, self._length + k.shape[2]
        if self._keys is None or end > self._keys.shape[2]:
            capacity = max(end, 2 * (0 if self._keys is None else self._keys.shape[2]), 64)
            keys = k.new_empty((*k.shape[:2], capacity, k.shape[3]))
            values = v.new_empty((*v.shape[:2], capacity, v.shape[3]))
            if start:
                keys[:, :, :start], values[:, :, :start] = self._keys[:, :, :start], self._values[:, :, :start]
            self._keys, self._values = keys, values
        self._keys[:, :, start:end], self._values[:, :, start:end] = k, v
        self._length = end
        return self.keys, self.values

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        self._length = max(0, min(length, self._length))


class FeatureHead(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = c = config
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))  # draft id -> offset
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))  # target ids it can emit

    def fuse(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """g: the target's three configured layers' hidden states [..., h] -> [..., h]."""
        return self.fc(torch.cat([hidden_states[i] for i in self.config.target_layers], dim=-1))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, cache: HeadCache) -> torch.Tensor:
        """embeds [T, h] (of the tokens at positions p+1 ..), features [T, h] (fused or the head's
        own, at positions p ..), after the ``len(cache)`` positions the cache holds: the head's
        hidden states [T, h] (each predicts the token after its embedding's)."""
        start = len(cache)
        positions = torch.arange(start, start + embeds.shape[0], device=embeds.device)
        return self.midlayer(embeds, features, positions, cache)

    def decode_rows(self, embeds: torch.Tensor, features: torch.Tensor, caches: list[HeadCache]) -> torch.Tensor:
        """Drafting one token in each of B sequences at once: embeds and features [B, h], row i
        after what ``caches[i]`` holds (each cache takes its new position) -> hidden states [B, h];
        row i is what ``forward`` gives that sequence alone."""
        positions = torch.tensor([len(cache) for cache in caches], device=embeds.device)
        return self.midlayer.decode_rows(embeds, features, positions, caches)

    def two_steps(self, embeds: torch.Tensor, features: torch.Tensor, next_embeds: torch.Tensor):
        """Training (batched, no cache): the first and second drafting steps over whole windows;
        see ``_MidLayer.two_steps``."""
        return self.midlayer.two_steps(embeds, features, next_embeds)

    def beside(self, embeds: torch.Tensor, features: torch.Tensor, cache: HeadCache) -> torch.Tensor:
        """Pairs for one position after what ``cache`` holds, alternatives to each other (a deep
        tree's siblings): embeds [n, h], features [n, h] -> the head's hidden states [n, h], each
        what ``forward`` gives for its pair alone; the cache is left as it was."""
        return self.midlayer.beside(embeds, features, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Over the head's vocabulary [T, draft_vocab]; ``target_ids`` maps its indices."""
        return self.lm_head(self.norm(hidden))

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def check_fits(self, target_config, where: str) -> None:
        """The head reads this target's hidden states and emits its ids: one-line errors otherwise."""
        c, layers = self.config, target_config.num_hidden_layers
        if c.hidden_size != target_config.hidden_size:
            raise ModelLoadError(f"{where}: the head's hidden size is {c.hidden_size}, the target's "
                                 f"{target_config.hidden_size}")
        if c.vocab_size != target_config.vocab_size:
            raise ModelLoadError(f"{where}: the head maps to a vocabulary of {c.vocab_size}, the target has "
                                 f"{target_config.vocab_size}")
        if not all(0 <= i <= layers for i in c.target_layers):
            raise ModelLoadError(f"{where}: the head fuses target layers {list(c.target_layers)}, the target "
                                 f"has hidden states 0..{layers}")
        top = int(self.target_ids(torch.arange(c.draft_vocab_size)).max()) if c.draft_vocab_size else 0
        if top >= c.vocab_size or int(self.target_ids(torch.arange(c.draft_vocab_size)).min()) < 0:
            raise ModelLoadError(f"{where}: d2t maps a draft id outside the target's vocabulary of {c.vocab_size}")


def _rotary(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    angles = positions.float()[..., None] * inv  # [..., d / 2]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def save_head(head: FeatureHead, directory: str | Path) -> Path:
    """Write the head in the published layout (config.json, model.safetensors)."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(head.config.to_dict(), indent=1) + "\n")
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(out / WEIGHTS))
    return out


def load_head(directory: str | Path, target_config=None, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> FeatureHead:
    """A head from a directory in the published layout; checked against the target's config when
    given. Missing, extra-shaped or unexpected tensors are one-line errors naming them."""
    where = str(directory)
    path = Path(directory)
    try:
        raw = json.loads((path / "config.json").read_text())
    except OSError as exc:
        raise ModelLoadError(f"{where}: cannot read config.json ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{where}: config.json is not JSON ({exc.msg}, line {exc.lineno})") from None
    count = None if target_config is None else target_config.num_hidden_layers
    head = FeatureHead(HeadConfig.from_dict(raw, where, count))
    state = _read_weights(path, where)
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"{where}: the checkpoint lacks {', '.join(missing[:4])}"
                             + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ModelLoadError(f"{where}: {name} has shape {list(state[name].shape)}, the config says "
                                 f"{list(tensor.shape)}")
    state = {k: v for k, v in state.items() if k in expected}  # e.g. a copy of the target's embedding
    state["t2d"] = state["t2d"].to(torch.bool)
    state["d2t"] = state["d2t"].to(torch.long)
    head.load_state_dict(state)
    head = head.to(device=device)
    for module in (head.fc, head.midlayer, head.norm, head.lm_head):
        module.to(dtype=dtype)
    if target_config is not None:
        head.check_fits(target_config, where)
    return head.eval()


def _read_weights(path: Path, where: str) -> dict[str, torch.Tensor]:
    if (path / WEIGHTS).exists():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path / WEIGHTS))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{where}: cannot read {WEIGHTS} ({exc})") from None
    if (path / LEGACY_WEIGHTS).exists():
        try:
            return torch.load(path / LEGACY_WEIGHTS, map_location="cpu", weights_only=True)
        except Exception as exc:  # a pickle that is not plain tensors, or a truncated file
            raise ModelLoadError(f"{where}: cannot read {LEGACY_WEIGHTS} ({type(exc).__name__})") from None
    raise ModelLoadError(f"{where}: no {WEIGHTS} or {LEGACY_WEIGHTS} there")
