"""What a forward costs on a device this machine does not have: a step-time model for a model on a
device (or tensor-parallel over several), and the links between devices. The first part of
planning a cluster before one is at hand (the issue on cluster timings); no torch.

A forward of a decoder reads its weights once and each sequence's KV cache, and does about two
FLOPs per weight per token plus attention's. Its time is the larger of the bytes over the memory
bandwidth and the FLOPs over the peak, each at the fraction of the published figure that a tuned
engine reaches (``Efficiency``), plus a floor per forward (kernel launches, the host's step).
Tensor parallel over n devices splits the bytes and the FLOPs n ways and adds two all-reduces of
the step's activations per layer over the devices' interconnect. A table measured on a real GPU
(``svip_bench.gpu_throughput``'s ``target_step`` rows) replaces the model where it has a row.

Where the figures come from (each entry says it too):
- H100 SXM5 80 GB: 3.35 TB/s HBM3, 989 TFLOPS dense BF16, NVLink 4 at 900 GB/s (NVIDIA H100
  Tensor Core GPU datasheet).
- H200 SXM 141 GB: 4.8 TB/s HBM3e, 989 TFLOPS dense BF16 (the H100's compute), NVLink 4 at
  900 GB/s (NVIDIA H200 Tensor Core GPU datasheet).
- Model shapes: each checkpoint's config.json on the Hugging Face hub (meta-llama/Llama-3.1-8B,
  -70B, Llama-3.2-1B, Qwen/Qwen2.5-7B, -0.5B; the EAGLE-3 head for Llama-3.1-8B: one decoder layer at
  the target's width, a fusion of three of its layers' states, a 32k-token draft vocabulary,
  yuhuili/EAGLE3-LLaMA3.1-Instruct-8B).
- Links: 25 and 100 GbE at their line rates with a 25 us one-way latency through the kernel's TCP
  stack; two devices of one node: 10 us and PCIe Gen5 x16's 64 GB/s (an estimate, not a datasheet).
- Efficiency (0.8 of the bandwidth, 0.6 of the peak) and the floor (20 us per layer: unfused
  kernels, no CUDA graphs): estimates; a measured table (``measured``) is what refines them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from svip_common.errors import InvalidRequest

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape, as its config.json gives it."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False  # the output projection is the embedding table
    extra_params: int = 0  # outside the layers and the embedding (a feature head's fusion)
    source: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attention = h * h + 2 * h * kv + h * h  # q, k, v, o
        return attention + 3 * h * self.intermediate + 2 * h  # gated MLP, two norms

    def params(self) -> int:
        embedding = self.vocab * self.hidden
        return self.layers * self.layer_params() + embedding * (1 if self.tied else 2) + self.extra_params

    def compute_params(self) -> int:
        """The weights a token multiplies (not the embedding lookup)."""
        return self.layers * self.layer_params() + self.vocab * self.hidden + self.extra_params

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_config(cls, name: str, config: dict) -> ModelShape:
        """From a Hugging Face config.json (a Llama- or Qwen2-style decoder)."""
        try:
            return cls(name, config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
                       config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"]),
                       config["vocab_size"], bool(config.get("tie_word_embeddings", False)), source="config.json")
        except KeyError as exc:
            raise InvalidRequest(f"{name}: config.json lacks {exc.args[0]!r} (a decoder's shape)") from None


@dataclass(frozen=True)
class Device:
    name: str
    memory_bandwidth: float  # bytes/s
    peak_flops: float  # dense, at the dtype
    memory_bytes: float
    interconnect: float  # bytes/s between devices of one node (tensor parallel)
    source: str


@dataclass(frozen=True)
class Link:
    """Between the draft's device and the target's: one way."""

    name: str
    latency_s: float
    bandwidth: float  # bytes/s
    source: str

    def transfer_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Efficiency:
    bandwidth: float = 0.8
    flops: float = 0.6
    floor_per_layer_s: float = 20e-6
    all_reduce_s: float = 8e-6  # latency of one all-reduce over NVLink at small sizes


@dataclass(frozen=True)
class StepModel:
    """A forward's time for ``shape`` on ``count`` devices (tensor parallel)."""

    shape: ModelShape
    device: Device
    count: int = 1
    dtype_bytes: int = 2
    efficiency: Efficiency = Efficiency()
    measured: tuple[tuple[int, int, float], ...] = ()  # (batch, tokens per sequence, seconds) from a real GPU

    @property
    def name(self) -> str:
        return f"{self.shape.name}@{self.count}x{self.device.name}" if self.count > 1 else \
            f"{self.shape.name}@{self.device.name}"

    def fits(self) -> bool:
        return self.shape.params() * self.dtype_bytes <= self.count * self.device.memory_bytes

    def forward_s(self, sequences: Sequence[tuple[int, int]]) -> float:
        """One forward over ``sequences``: (new tokens, tokens cached before them) each."""
        if not sequences:
            return 0.0
        measured = self._measured(sequences)
        if measured is not None:
            return measured
        s, e, n = self.shape, self.efficiency, self.count
        tokens = sum(new for new, _ in sequences)
        kv_read = sum(cached + new for new, cached in sequences) * s.kv_bytes_per_token(self.dtype_bytes)
        weights = s.params() * self.dtype_bytes
        memory_s = (weights + kv_read) / n / (self.device.memory_bandwidth * e.bandwidth)
        attention = sum(4 * s.layers * s.hidden * new * (cached + new) for new, cached in sequences)
        compute_s = (2 * s.compute_params() * tokens + attention) / n / (self.device.peak_flops * e.flops)
        floor_s = s.layers * e.floor_per_layer_s
        if n > 1:  # two all-reduces of the step's activations per layer
            volume = 2 * (n - 1) / n * tokens * s.hidden * self.dtype_bytes
            floor_s += 2 * s.layers * (e.all_reduce_s + volume / self.device.interconnect)
        return max(memory_s, compute_s) + floor_s

    def _measured(self, sequences) -> float | None:
        """A measured row for this batch and tokens per sequence (all alike), if the table has one."""
        if not self.measured or len({new for new, _ in sequences}) != 1:
            return None
        key = (len(sequences), sequences[0][0])
        return next((s for b, k, s in self.measured if (b, k) == key), None)

    def with_measured(self, rows: Iterable[dict]) -> StepModel:
        """This model refined by ``svip_bench.gpu_throughput``'s rows ({batch, tokens_per_seq, ms})."""
        table = tuple((int(r["batch"]), int(r["tokens_per_seq"]), float(r["ms"]) / 1000) for r in rows)
        return dataclasses.replace(self, measured=table)


_H100 = Device("h100", 3.35e12, 989e12, 80e9, 450e9,
               "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 3.35 TB/s, 989 TFLOPS BF16 dense, NVLink 900 GB/s)")
_H200 = Device("h200", 4.8e12, 989e12, 141e9, 450e9,
               "NVIDIA H200 Tensor Core GPU datasheet (SXM: 4.8 TB/s, 989 TFLOPS BF16 dense, NVLink 900 GB/s)")
DEVICES = {d.name: d for d in (_H100, _H200)}

_HUB = "config.json on the Hugging Face hub: "
MODELS = {m.name: m for m in (
    ModelShape("llama-3.1-8b", 32, 4096, 14336, 32, 8, 128256, source=_HUB + "meta-llama/Llama-3.1-8B"),
    ModelShape("llama-3.1-70b", 80, 8192, 28672, 64, 8, 128256, source=_HUB + "meta-llama/Llama-3.1-70B"),
    ModelShape("llama-3.2-1b", 16, 2048, 8192, 32, 8, 128256, tied=True, source=_HUB + "meta-llama/Llama-3.2-1B"),
    ModelShape("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, source=_HUB + "Qwen/Qwen2.5-7B"),
    ModelShape("qwen2.5-0.5b", 24, 896, 4864, 14, 2, 151936, tied=True, source=_HUB + "Qwen/Qwen2.5-0.5B"),
    # one decoder layer at the target's width; the fusion of three target layers (3h -> h); its own
    # 32k vocabulary; the embedding is the target's (not counted)
    ModelShape("eagle3-llama-3.1-8b", 1, 4096, 14336, 32, 8, 32000, tied=True, extra_params=3 * 4096 * 4096,
               source=_HUB + "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),
    ModelShape("eagle3-llama-3.3-70b", 1, 8192, 28672, 64, 8, 32000, tied=True, extra_params=3 * 8192 * 8192,
               source=_HUB + "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B"),
)}

LINKS = {link.name: link for link in (
    Link("node", 10e-6, 64e9, "estimate: two devices of one node over PCIe Gen5 x16 (64 GB/s), 10 us"),
    Link("25gbe", 25e-6, 25e9 / 8, "25 GbE line rate; 25 us one way through TCP (estimate)"),
    Link("100gbe", 25e-6, 100e9 / 8, "100 GbE line rate; 25 us one way through TCP (estimate)"),
)}

_PLACED = re.compile(r"^(?P<model>[a-z0-9.\-]+)@(?:(?P<count>\d+)x)?(?P<device>[a-z0-9]+)$")


def step_model(spec: str, dtype: str = "bfloat16") -> StepModel:
    """``model@device`` or ``model@NxDevice`` from the shipped tables (a one-line error lists the
    known names)."""
    match = _PLACED.match(spec.strip().lower())
    if match is None:
        raise InvalidRequest(f"{spec!r}: write MODEL@DEVICE or MODEL@NxDEVICE, e.g. llama-3.1-70b@4xh100")
    model, device = match["model"], match["device"]
    if model not in MODELS:
        raise InvalidRequest(f"unknown model {model!r}; known: {', '.join(sorted(MODELS))}")
    if device not in DEVICES:
        raise InvalidRequest(f"unknown device {device!r}; known: {', '.join(sorted(DEVICES))}")
    count = int(match["count"] or 1)
    if not 1 <= count <= 8:
        raise InvalidRequest(f"{spec!r}: tensor parallel over 1 to 8 devices of one node, not {count}")
    if dtype not in DTYPE_BYTES:
        raise InvalidRequest(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    out = StepModel(MODELS[model], DEVICES[device], count, DTYPE_BYTES[dtype])
    if not out.fits():
        need, each = out.shape.params() * out.dtype_bytes / 1e9, out.device.memory_bytes / 1e9
        raise InvalidRequest(f"{spec}: {need:.0f} GB of weights do not fit {count} x {each:.0f} GB")
    return out


def link(name: str) -> Link:
    """A shipped link by name, or ``<latency>ms`` / ``<latency>us`` (same node's bandwidth)."""
    key = name.strip().lower()
    if key in LINKS:
        return LINKS[key]
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|us)", key)
    if match is None:
        raise InvalidRequest(f"unknown link {name!r}; known: {', '.join(LINKS)}, or a latency such as 0.1ms")
    latency = float(match[1]) * (1e-3 if match[2] == "ms" else 1e-6)
    if not math.isfinite(latency) or latency > 1.0:
        raise InvalidRequest(f"link latency {name!r}: at most 1 s")
    return Link(key, latency, LINKS["node"].bandwidth, f"given: {key} one way")
