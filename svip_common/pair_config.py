"""One typed configuration for a model pair and how its workers run: the models, where the workers
go, their KV and batch budgets, speculation's knobs, and what happens when a worker is lost. Frozen,
checked once (``checked``). Each field but the models, `packed` and placement_timeout_s is a knob:
its type, default, bounds and help are declared in svip_common/knobs.py and nowhere else. The CLI
(svip_cli/main.py, through coordinator/front.py), the Serve app's settings
(ServeSettings.pair_config) and the benches build one; the in-process engine
(SpeculativeEngine) and the worker pair (coordinator/cluster.py) and its actors take it whole. No
torch: the CLI checks it before loading the model stack."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from svip_common.auto_settings import AutoSettings
from svip_common.emulation import Emulation, parse_emulation
from svip_common.errors import InvalidRequest
from svip_common.knobs import knob


def _knob(name: str):
    """A field whose default is the knob's (svip_common/knobs.py)."""
    return field(default=knob(name).default, metadata={"knob": name})


def check_tp_degree(degree, flag: str = "tensor parallel degree") -> int:
    """A tensor-parallel degree within its bounds (whether the model's heads divide by it is
    checked at load, tensor_parallel.check_degree)."""
    return knob("target_tp").check(degree, flag)


def check_gpus(tp: int, gpus: int, role: str = "target") -> None:
    """A tensor-parallel model's ranks take a GPU each: its layers are not spread over more."""
    if tp > 1 and gpus > 1:
        raise InvalidRequest(f"a tensor-parallel {role} takes one GPU a rank: give {role}_tp, not {role}_gpus")


@dataclass(frozen=True)
class Recovery:
    """What happens when a worker is lost (docs/architecture.md, Placement): a view of the pair's
    recovery knobs."""

    worker_restarts: int  # Ray restarts a worker that died this many times over the pair's life
    draft_stall_s: float  # the least a session waits on its draft before it goes on without it
    sampled_hold_s: float  # a sampled session waits this long for a lost draft (so its seed reproduces)
    draft_recover_s: float  # how long one ask for a replaced draft may take: as long as a worker's start


@dataclass(frozen=True)
class PairConfig:
    target: str  # the target model: a directory or a hub id
    draft: str | None  # the draft model or feature head (EAGLE-3 layout); None: the target alone
    dtype: str = _knob("dtype")
    device: str = _knob("device")
    target_gpus: int = _knob("target_gpus")  # read with device cuda only (gpus_of)
    target_tp: int = _knob("target_tp")
    draft_gpus: int = _knob("draft_gpus")
    draft_tp: int = _knob("draft_tp")
    worker_cpus: float = _knob("worker_cpus")
    layout: str | None = _knob("layout")
    packed: bool = False  # the caller's placement puts both workers on one node: they talk over loopback
    insecure_workers: bool = _knob("insecure_workers")
    grpc_tls_dir: str | None = _knob("grpc_tls_dir")
    kv_cache_tokens: int = _knob("kv_cache_tokens")
    max_batched_tokens: int | None = _knob("max_batched_tokens")
    draft_length_cap: int = _knob("draft_length_cap")
    load_aware: str = _knob("load_aware")
    idle_prefill: str = _knob("idle_prefill")
    draft_parallel: int = _knob("draft_parallel")
    auto_learn: bool = _knob("auto_learn")
    auto_cost: float | None = _knob("auto_cost")
    auto_window: int = _knob("auto_window")
    worker_start_timeout_s: float = _knob("worker_start_timeout_s")
    worker_restarts: int = _knob("worker_restarts")
    draft_stall_s: float = _knob("draft_stall_s")
    sampled_hold_s: float = _knob("sampled_hold_s")
    emulate: str | None = _knob("emulate")
    placement_timeout_s: float = 120.0  # Ray finds each worker a GPU (or a CPU and its role resource): not a knob

    def checked(self) -> PairConfig:
        """The configuration, every field checked once (InvalidRequest names the first bad one)."""
        values = {f.name: knob(f.name).check(getattr(self, f.name))
                  for f in dataclasses.fields(self) if "knob" in f.metadata}
        if not self.placement_timeout_s > 0:
            raise InvalidRequest(f"placement_timeout_s must be > 0, got {self.placement_timeout_s}")
        check_gpus(self.target_tp, self.target_gpus)
        check_gpus(self.draft_tp, self.draft_gpus, "draft")
        if self.draft_tp > 1 and self.draft is None:
            raise InvalidRequest("draft_tp needs a draft model (the pair has none)")
        self.auto.check()
        if self.emulate is not None:
            self.emulation()
        return dataclasses.replace(self, **values)

    @property
    def on_gpus(self) -> bool:
        return self.device.startswith("cuda")

    def gpus_of(self, role: str) -> int:
        """GPUs a worker (its rank 0) asks Ray for: none on the CPU; a tensor-parallel model's ranks one each."""
        if not self.on_gpus:
            return 0
        if role == "draft":
            return self.draft_gpus if self.draft_tp == 1 else 1
        return self.target_gpus if self.target_tp == 1 else 1

    @property
    def auto(self) -> AutoSettings:
        """Policy auto's knobs (svip_common/acceptance.py)."""
        return AutoSettings(learn=self.auto_learn, cost=self.auto_cost, window=self.auto_window)

    @property
    def recovery(self) -> Recovery:
        return Recovery(self.worker_restarts, self.draft_stall_s, self.sampled_hold_s, self.worker_start_timeout_s)

    def emulation(self) -> Emulation | None:
        """The devices this pair's forwards are timed as (None: as the model runs)."""
        return None if self.emulate is None else worker_emulation(self.emulate, self.draft is not None)

    @classmethod
    def of(cls, target: str, draft: str | None, **options) -> PairConfig:
        """From keyword options (knobs; those that are not this configuration's are refused), checked."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise InvalidRequest(f"not a pair setting: {', '.join(unknown)}")
        return cls(target, draft, **options).checked()

    def replace(self, **changes) -> PairConfig:
        """A copy with these fields changed, checked."""
        return dataclasses.replace(self, **changes).checked()


def pair_options(values: dict) -> dict:
    """The entries of a surface's values (knob name -> value) that are pair settings."""
    names = {f.name for f in dataclasses.fields(PairConfig) if "knob" in f.metadata}
    return {name: value for name, value in values.items() if name in names}


def worker_emulation(spec: str, has_draft: bool) -> Emulation:
    """A spec for a pair of workers, checked: a draft named where the pair has one. Each worker has a
    device of its own (a draft named on devices like the target's gets devices like them, its own)."""
    emulation = parse_emulation(spec)
    if has_draft and emulation.draft is None:
        raise InvalidRequest(f"--emulate {spec!r} names no draft, and the pair has one (draft=MODEL@DEVICE)")
    return emulation
