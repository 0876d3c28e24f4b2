"""What `svip bench` compares: the project's policies, the oracle ceiling, and the peer —
Hugging Face transformers' own assisted generation — each run on one prompt into a `Run`."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig
from svip_common.knobs import default


@dataclass(frozen=True)
class Method:
    name: str
    # target | constant | heuristic | confidence | svip | svip-auto | auto | oracle | defaults | hf-constant
    # | hf-heuristic
    family: str
    policy: PolicyConfig | None = None  # the project's engine
    hf: dict | None = None  # Hugging Face generate(assistant_model=...) settings
    k: int | None = None
    load_aware: str = "off"  # the engine's load-aware mode for this method's runs (bench methods: off)
    head: bool = False  # drafted by the feature head (rows named eagle-*), not the small draft


HEAD_PREFIX = "eagle-"  # the feature draft's rows: eagle-constant-K, eagle-svip, ...


@dataclass
class Run:
    method: str
    category: str
    prompt_id: str
    repeat: int
    token_ids: list[int]
    wall_s: float
    target_forwards: int
    draft_forwards: int
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    rounds: int | None = None
    draft_lengths: list[int] = field(default_factory=list)
    # (draft entropy, accepted?) for each drafted token whose prefix the target had accepted
    entropy_acceptance: list[tuple[float, bool]] = field(default_factory=list)


def build_methods(
    ks: list[int],
    svip_threshold: float,
    auto_threshold: float,
    include_hf: bool,
    thresholds: tuple[float, ...] = (),
    confidences: tuple[float, ...] = (),
) -> list[Method]:
    """thresholds / confidences: SVIP and the confidence stop at these values too (a grid, for
    the best fixed method in hindsight), as svip-T and confidence-C."""
    methods = [Method("target", "target", PolicyConfig(name="none"))]
    methods += [Method(f"constant-{k}", "constant", PolicyConfig(name="constant", draft_length=k), k=k) for k in ks]
    methods += [
        Method("heuristic", "heuristic", PolicyConfig(name="heuristic", draft_length=5)),
        Method("confidence", "confidence", PolicyConfig(name="confidence")),
        Method("svip", "svip", PolicyConfig(name="svip", threshold=svip_threshold)),
        Method("svip-auto", "svip-auto", PolicyConfig(name="svip", threshold=auto_threshold)),
        Method("auto", "auto", PolicyConfig(name="auto")),
        Method("oracle", "oracle", PolicyConfig(name="oracle", oracle_tokens=(0,))),
        # exactly what `svip generate` does with no flags: its policy and load-aware mode
        Method("defaults", "defaults", PolicyConfig(), load_aware=default("load_aware")),
    ]
    methods += [Method(f"svip-{t:g}", "svip", PolicyConfig(name="svip", threshold=t)) for t in thresholds]
    methods += [
        Method(f"confidence-{c:g}", "confidence", PolicyConfig(name="confidence", confidence=c)) for c in confidences
    ]
    if include_hf:
        methods += [
            Method(
                f"hf-constant-{k}",
                "hf-constant",
                k=k,
                hf=dict(
                    num_assistant_tokens=k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0
                ),
            )
            for k in ks
        ]
        methods.append(
            Method(
                "hf-heuristic",
                "hf-heuristic",
                k=5,
                hf=dict(
                    num_assistant_tokens=5,
                    num_assistant_tokens_schedule="heuristic_transient",
                    assistant_confidence_threshold=0.0,
                ),
            )
        )
    return methods


def build_head_methods(ks: list[int], svip_threshold: float, thresholds: tuple[float, ...] = (),
                       auto_threshold: float | None = None) -> list[Method]:
    """The feature draft's rows: every policy on the head (SVIP at the given threshold, at the
    head's calibrated one, coordinator/head_calibration.py, and at the --thresholds grid), the
    oracle ceiling on it."""
    def row(name: str, family: str, policy: PolicyConfig, k: int | None = None) -> Method:
        return Method(HEAD_PREFIX + name, family, policy, k=k, head=True)

    methods = [row(f"constant-{k}", "constant", PolicyConfig(name="constant", draft_length=k), k) for k in ks]
    methods += [
        row("heuristic", "heuristic", PolicyConfig(name="heuristic", draft_length=5)),
        row("confidence", "confidence", PolicyConfig(name="confidence")),
        row("svip", "svip", PolicyConfig(name="svip", threshold=svip_threshold)),
        *([row("svip-auto", "svip-auto", PolicyConfig(name="svip", threshold=auto_threshold))]
          if auto_threshold is not None else []),
        row("auto", "auto", PolicyConfig(name="auto")),
        row("oracle", "oracle", PolicyConfig(name="oracle", oracle_tokens=(0,))),
    ]
    methods += [row(f"svip-{t:g}", "svip", PolicyConfig(name="svip", threshold=t)) for t in thresholds]
    return methods


class ForwardCounter:
    """Counts a model's forward calls through a forward hook (used for the Hugging Face peer,
    which reports no statistics of its own)."""

    def __init__(self, model):
        self.count = 0
        model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.count += 1


def run_engine(
    engine: SpeculativeEngine, method: Method, ids: tuple[int, ...], max_new: int, reference: list[int]
) -> dict:
    policy = method.policy
    if method.family == "oracle":
        policy = dataclasses.replace(policy, oracle_tokens=tuple(ids) + tuple(reference))
    pairs: list[tuple[float, bool]] = []

    def on_round(block, verdict, settled):
        for i, h in enumerate(block.entropies[: verdict.accepted + 1]):
            pairs.append((h, i < verdict.accepted))

    saved, engine.load_aware = engine.load_aware, method.load_aware
    try:
        result = engine.generate(GenerationRequest(ids, max_new, policy=policy), on_round=on_round)
    finally:
        engine.load_aware = saved
    s = result.stats
    return dict(
        token_ids=result.token_ids,
        wall_s=s.wall_s,
        target_forwards=s.target_forwards,
        draft_forwards=s.draft_forwards,
        draft_tokens=s.draft_tokens,
        accepted_tokens=s.accepted_tokens,
        rounds=s.rounds,
        draft_lengths=s.draft_lengths,
        entropy_acceptance=pairs,
    )


@torch.inference_mode()
def run_hf(
    engine: SpeculativeEngine, counters: tuple[ForwardCounter, ForwardCounter], method: Method, ids, max_new: int
) -> dict:
    target, draft = engine.target, engine.drafter.draft
    t_count, d_count = counters
    t0, d0 = t_count.count, d_count.count
    input_ids = torch.tensor([list(ids)], device=target.model.device)
    # Hugging Face reads the schedule from the assistant's own generation config, not from
    # generate()'s keyword arguments
    assistant_config = draft.model.generation_config
    saved = {key: getattr(assistant_config, key, None) for key in method.hf}
    for key, value in method.hf.items():
        setattr(assistant_config, key, value)
    try:
        start = time.perf_counter()
        out = target.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            assistant_model=draft.model,
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=list(target.eos_token_ids) or None,
            pad_token_id=(target.eos_token_ids or (0,))[0],
        )
        wall = time.perf_counter() - start
    finally:
        for key, value in saved.items():
            setattr(assistant_config, key, value)
    return dict(
        token_ids=out[0, len(ids) :].tolist(),
        wall_s=wall,
        target_forwards=t_count.count - t0,
        draft_forwards=d_count.count - d0,
    )
