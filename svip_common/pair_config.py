"""One typed configuration for a distributed pair and how its workers run: the models, where the
workers go, their KV and batch budgets, speculation's knobs, and what happens when a worker is
lost. Frozen, checked once (``checked``), each field documented here and nowhere else; the CLI
(`svip generate --mode distributed`), the Serve app's settings (ServeSettings.pair_config) and the
benches build one, and the worker pair (coordinator/cluster.py) and its actors take it whole. No
torch: the CLI checks it before loading the model stack."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from svip_common.auto_settings import AutoSettings
from svip_common.contracts import DRAFT_LENGTH_CAP, DRAFT_PARALLEL, check_draft_parallel
from svip_common.emulation import Emulation, parse_emulation
from svip_common.errors import InvalidRequest
from svip_common.kv_sizes import DEFAULT_KV_TOKENS
from svip_common.step_cost import check_idle_prefill, check_load_aware

LAYOUTS = ("pack", "spread")
MAX_TP_DEGREE = 8  # a tensor-parallel target's ranks at most: one node's GPUs (svip_common/tensor_parallel.py)


def check_tp_degree(degree, flag: str = "tensor parallel degree") -> int:
    """A tensor-parallel degree within its bounds (whether the model's heads divide by it is
    checked at load, tensor_parallel.check_degree)."""
    if isinstance(degree, bool) or not isinstance(degree, int) or not 1 <= degree <= MAX_TP_DEGREE:
        raise InvalidRequest(f"{flag} must be an integer in [1, {MAX_TP_DEGREE}], got {degree!r}")
    return degree


@dataclass(frozen=True)
class Recovery:
    """What happens when a worker is lost (docs/architecture.md, Placement)."""

    max_restarts: int = 5  # Ray restarts a worker that died this many times over the pair's life
    draft_stall_s: float = 3.0  # the least a session waits on its draft before it goes on without it
    sampled_hold_s: float = 30.0  # a sampled session waits this long for a lost draft (so its seed reproduces)
    draft_recover_s: float = 120.0  # how long one ask for a replaced draft may take

    def checked(self) -> Recovery:
        if self.max_restarts < 0:
            raise InvalidRequest(f"worker restarts must be >= 0, got {self.max_restarts}")
        for name in ("draft_stall_s", "sampled_hold_s", "draft_recover_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InvalidRequest(f"{name} must be a positive number of seconds, got {value}")
        return self


@dataclass(frozen=True)
class PairConfig:
    target: str  # the target model: a directory or a hub id
    draft: str | None  # the draft model or feature head (EAGLE-3 layout); None: the target alone
    dtype: str = "float32"  # the models' weights: float32, bfloat16, float16, auto
    device: str = "cpu"  # "cpu", or "cuda": each worker takes GPUs
    target_gpus: int = 0  # GPUs the target spans (one node); 0 on the CPU
    target_tp: int = 1  # the target's tensor-parallel ranks: a Ray actor and a GPU each (a CPU core without)
    draft_gpus: int = 0  # GPUs the draft takes; 0 on the CPU
    worker_cpus: float = 1.0  # logical CPUs each worker reserves
    layout: str | None = None  # "pack" / "spread": a placement group of the pair's own; None: the caller's
    packed: bool = False  # the caller's placement puts both workers on one node: they talk over loopback
    insecure_workers: bool = False  # plaintext gRPC between nodes (refused otherwise without grpc_tls_dir)
    grpc_tls_dir: str | None = None  # mutual TLS between the workers: ca.crt, tls.crt, tls.key
    kv_cache_tokens: int = DEFAULT_KV_TOKENS  # each worker's KV pool
    max_batched_tokens: int | None = None  # at most this many tokens in one forward (prompts in chunks)
    max_draft_length: int = DRAFT_LENGTH_CAP  # the longest block a request may ask for
    load_aware: str = "greedy"  # whose blocks follow the target's load: off, greedy, all (step_cost.py)
    idle_prefill: str = "auto"  # the target, idle, takes in what waiting sessions need first: auto, always, off
    draft_parallel: int = DRAFT_PARALLEL  # blocks an async session drafts side by side on forked KV pages: its
    # follow-up and the continuations prepared for a rejection (draft_worker/pipelined.py); 1: one at a time
    auto: AutoSettings = field(default_factory=AutoSettings)  # policy auto's knobs (auto_settings.py)
    recovery: Recovery = field(default_factory=Recovery)
    start_timeout_s: float = 600.0  # a worker loads its weights within this (a first download counts)
    placement_timeout_s: float = 120.0  # Ray finds each worker a GPU (or a CPU and its role resource)
    emulate: str | None = None  # device timing on this machine: each worker's forwards last its model's step on
    # the device this spec names (svip_common/emulation.py; a device of its own each); None: as the model runs

    def checked(self) -> PairConfig:
        """The configuration, every field checked once (InvalidRequest names the first bad one)."""
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise InvalidRequest(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise InvalidRequest(f"placement must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        for name in ("target_gpus", "draft_gpus"):
            if getattr(self, name) < 0:
                raise InvalidRequest(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.worker_cpus > 0:
            raise InvalidRequest(f"worker_cpus must be > 0, got {self.worker_cpus}")
        if self.kv_cache_tokens < 1:
            raise InvalidRequest(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")
        if self.max_batched_tokens is not None and self.max_batched_tokens < 1:
            raise InvalidRequest(f"max_batched_tokens must be >= 1, got {self.max_batched_tokens}")
        if not 1 <= self.max_draft_length <= DRAFT_LENGTH_CAP:
            raise InvalidRequest(f"max_draft_length must be in 1..{DRAFT_LENGTH_CAP}, got {self.max_draft_length}")
        for name in ("start_timeout_s", "placement_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidRequest(f"{name} must be > 0, got {getattr(self, name)}")
        check_tp_degree(self.target_tp, "target_tp")
        if self.target_tp > 1 and self.target_gpus > 1:
            raise InvalidRequest("a tensor-parallel target takes one GPU a rank: give target_tp, not target_gpus")
        check_load_aware(self.load_aware)
        check_idle_prefill(self.idle_prefill)
        check_draft_parallel(self.draft_parallel)
        self.auto.check()
        self.recovery.checked()
        if self.emulate is not None:
            self.emulation()
        return self

    def emulation(self) -> Emulation | None:
        """The devices this pair's forwards are timed as (None: as the model runs)."""
        return None if self.emulate is None else worker_emulation(self.emulate, self.draft is not None)

    @classmethod
    def of(cls, target: str, draft: str | None, **options) -> PairConfig:
        """From flat keyword options, checked (a Recovery field among them goes to the recovery)."""
        names = {f.name for f in dataclasses.fields(Recovery)}
        recovery = Recovery(**{k: options.pop(k) for k in list(options) if k in names})
        return cls(target, draft, recovery=recovery, **options).checked()

    def replace(self, **changes) -> PairConfig:
        """A copy with these fields changed, checked."""
        return dataclasses.replace(self, **changes).checked()


def worker_emulation(spec: str, has_draft: bool) -> Emulation:
    """A spec for a pair of workers, checked: a draft named where the pair has one. Each worker has a
    device of its own (a draft named on devices like the target's gets devices like them, its own)."""
    emulation = parse_emulation(spec)
    if has_draft and emulation.draft is None:
        raise InvalidRequest(f"--emulate {spec!r} names no draft, and the pair has one (draft=MODEL@DEVICE)")
    return emulation
