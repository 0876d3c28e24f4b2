"""Runs the benchmark: prompts x methods x repeats, interleaved so that machine drift hits every
method alike, with the target-alone output of each prompt as the exactness reference."""

from __future__ import annotations

import json
import math
import platform
import random
import sys
from pathlib import Path

import torch

from coordinator.engine import SpeculativeEngine
from svip_bench.datasets import Prompt
from svip_bench.methods import ForwardCounter, Method, Run, run_engine, run_hf
from svip_common.contracts import GenerationRequest, PolicyConfig


def nearest_rank(values, q: float) -> float:
    """The q-quantile of values by the nearest-rank rule (p95: q = 0.95); values need not be sorted."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def write_results(out: Path, name: str, doc: dict, md: str) -> int:
    """A bench's results: ``name``.json and ``name``.md under out, the table printed; exit status 1
    (the violations on stderr) when any output differed from the target alone's."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{name}.md").write_text(md)
    print(md)
    violations = doc.get("exactness_violations") or []
    if violations:
        print(f"EXACTNESS VIOLATIONS ({len(violations)}): " + "; ".join(map(str, violations[:10])), file=sys.stderr)
        return 1
    return 0


def full(items: list, n: int) -> list:
    """At least n of them (the list again, in turn, where it is shorter): full waves of n in flight."""
    return [items[i % len(items)] for i in range(max(n, len(items)))]


def machine_description() -> str:
    import os

    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, torch threads="
        f"{torch.get_num_threads()}, python {platform.python_version()}, torch {torch.__version__}"
    )


def encode_prompts(engine: SpeculativeEngine, prompts: list[Prompt], max_prompt_tokens: int) -> list[tuple[int, ...]]:
    """Token ids, keeping the last max_prompt_tokens (long rag / summarization prompts)."""
    tok = engine.target.tokenizer
    return [tuple(tok(p.text)["input_ids"][-max_prompt_tokens:]) for p in prompts]


def reference_outputs(engine: SpeculativeEngine, encoded, max_new: int) -> list[list[int]]:
    """Target alone, greedy: the output every method must reproduce (and the oracle's knowledge).
    Also warms up both models."""
    refs = []
    for ids in encoded:
        refs.append(engine.generate(GenerationRequest(ids, max_new, policy=PolicyConfig(name="none"))).token_ids)
        engine.generate(GenerationRequest(ids, 8, policy=PolicyConfig(name="constant")))
    return refs


def run_all(
    engine: SpeculativeEngine,
    methods: list[Method],
    prompts: list[Prompt],
    max_new: int,
    repeats: int,
    max_prompt_tokens: int,
    seed: int = 0,
    progress=None,
    head_engine: SpeculativeEngine | None = None,
) -> tuple[list[Run], list[str]]:
    """All runs, and a list of exactness violations (method, prompt) — empty when all is well.
    head_engine: the same target with the feature head, for the methods that draft with it."""
    encoded = encode_prompts(engine, prompts, max_prompt_tokens)
    refs = reference_outputs(engine, encoded, max_new)
    counters = None
    if any(m.hf for m in methods):
        counters = (ForwardCounter(engine.target.model), ForwardCounter(engine.drafter.draft.model))
    runs, violations = [], []
    rng = random.Random(seed)
    for repeat in range(repeats):
        for prompt, ids, ref in zip(prompts, encoded, refs):
            order = list(methods)
            rng.shuffle(order)
            for method in order:
                if method.hf:
                    fields = run_hf(engine, counters, method, ids, max_new)
                else:
                    fields = run_engine(head_engine if method.head else engine, method, ids, max_new, ref)
                run = Run(
                    method=method.name, category=prompt.category, prompt_id=prompt.prompt_id, repeat=repeat, **fields
                )
                if run.token_ids != ref:
                    violations.append(f"{method.name} on {prompt.category}/{prompt.prompt_id}")
                runs.append(run)
                if progress is not None:
                    progress.update(1)
    return runs, violations


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr

    def update(self, n: int) -> None:
        self.done += n
        width = 30
        filled = int(width * self.done / max(1, self.total))
        self.stream.write(f"\rbench [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} runs")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()
