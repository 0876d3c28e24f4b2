"""The front of an engine the CLI runs: one configuration (svip_common/pair_config.py) and a mode,
and back one typed engine, in process (engine.py: both models here, a round at a time) or
distributed (local.py: the two worker actors over gRPC). A request goes from `svip generate` to
`Engine.generate` here, then to a round in either."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from svip_common.contracts import GenerationRequest, GenerationResult
from svip_common.errors import InvalidRequest
from svip_common.knobs import default
from svip_common.pair_config import PairConfig

if TYPE_CHECKING:
    from coordinator.engine import SpeculativeEngine

MODES = ("inprocess", "distributed")


class Engine(Protocol):
    """What the CLI runs requests on: both modes' engines are one."""

    target: object  # the target: its path and tokenizer (a LoadedModel in process, a ModelInfo distributed)

    @property
    def draft_path(self) -> str | None: ...

    def resolve(self, request: GenerationRequest) -> GenerationRequest: ...

    def generate(self, request: GenerationRequest) -> GenerationResult: ...

    def generate_many(self, requests: list[GenerationRequest], batch_size: int) -> list[GenerationResult]: ...

    def device_use(self) -> dict | None: ...

    def close(self) -> None: ...


def open_engine(config: PairConfig, mode: str = "inprocess", pipeline: str = default("pipeline"),
                ray_address: str | None = None) -> Engine:
    """The pair as ``config`` says, in ``mode``: distributed, the workers on Ray (an existing cluster's
    at ray_address; None: Ray on this machine, loopback only) and each request's pipeline sync or async."""
    if mode not in MODES:
        raise InvalidRequest(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "distributed":
        from coordinator.local import LocalDistributed

        return LocalDistributed(config, pipeline, ray_address)
    return load_inprocess(config)


def load_inprocess(config: PairConfig) -> SpeculativeEngine:
    """Both models in this process, as ``config`` says: a tensor-parallel target's other ranks as
    threads (the draft's too), a feature head beside it, device timing where it names devices."""
    import transformers

    from coordinator.engine import SpeculativeEngine
    from svip_common.models import is_feature_head

    config = config.checked()
    emulation = config.emulation()  # a bad spec named before any model loads
    timed = {} if emulation is None else {"target": emulation.target, "draft": emulation.draft}
    for role, tp in (("target", config.target_tp), ("draft", config.draft_tp)):
        devices = timed.get(role)
        if devices is not None and tp > 1 and devices.count != tp:
            raise InvalidRequest(f"{role}_tp {tp}, but emulate times the {role} on {devices.count} device(s): "
                                 f"name as many ({role}=MODEL@NxDEVICE)")
    head = config.draft is not None and is_feature_head(config.draft)
    if head and config.draft_tp > 1:
        raise InvalidRequest(f"draft_tp {config.draft_tp}: a feature head runs on one device")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    target = load_sharded(config.target, config.dtype, config.device, config.target_tp)
    if head:
        from draft_worker.feature_draft import load_feature_draft, load_head_beside

        # a shard holds part of the target's embedding: the head reads its own copy
        draft = (load_head_beside(config.draft, config.target, config.dtype, config.device) if config.target_tp > 1
                 else load_feature_draft(config.draft, target))
    else:
        draft = None if config.draft is None else load_sharded(config.draft, config.dtype, config.device,
                                                                 config.draft_tp)
    engine = SpeculativeEngine(target, draft, config)
    if emulation is not None:
        engine.time_as(emulation)
    return engine


def load_sharded(path: str, dtype: str, device: str, tp: int):
    """An in-process model: the whole of it, or (tp > 1) rank 0 of a tensor-parallel group whose
    other ranks are threads of this process (svip_common/tensor_parallel.py LocalRanks)."""
    from svip_common.models import DTYPES, load_model

    if tp == 1:
        return load_model(path, dtype, device)
    from transformers import AutoConfig

    from svip_common.tensor_parallel import LocalRanks, check_degree

    check_degree(AutoConfig.from_pretrained(path).get_text_config(decoder=True), tp)  # before any rank starts
    ranks = LocalRanks(path, tp, DTYPES.get(dtype, DTYPES["float32"]), device)
    model = load_model(path, dtype, device, group=ranks.group)
    model.ranks = ranks  # the threads live as long as the model
    return model
