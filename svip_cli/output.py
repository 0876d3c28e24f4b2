"""What `svip generate` writes: each output as text or as a JSON Lines object (its tokens,
logprobs, stats and the configuration it ran under), in input order, and the device timing
summary on stderr."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from coordinator.front import Engine
from svip_common.randomness import choices


def results_stream():
    """Standard output for the results alone: Ray prints its own notices (a worker that died and
    was restarted, say) on the process's stdout, which would break --json's JSON Lines. They go
    to stderr; the results keep the original stdout."""
    sys.stdout.flush()
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return results


def generate_all(args: argparse.Namespace, engine: Engine, prompts, base_request, out) -> bool:
    """Every prompt's --n outputs, in input order: one at a time, or --batch-size at once (one
    forward serves them all; each output is written when all are done). Returns whether every
    request succeeded (one of a batch can fail on its own: the others are still written)."""
    from svip_common.models import encode

    requests = []
    for prompt in prompts:
        ids = encode(engine.target.tokenizer, prompt)
        requests += choices(dataclasses.replace(base_request, prompt_ids=ids), args.n)
    if args.batch_size > 1:
        results = engine.generate_many(requests, args.batch_size)
        return all([_write(args, engine, request, result, out) for request, result in zip(requests, results)])
    return all([_write(args, engine, request, engine.generate(request), out) for request in requests])


def report_device_use(spec: str, use: dict | None) -> None:
    """One line on stderr per emulated device: its forwards, and those this machine ran past their step."""
    from svip_common.device_timing import use_summary

    for role, u in (use or {}).items():
        print(f"svip: device timing ({spec}): {role} as {u['model']}: {use_summary(u)}", file=sys.stderr)


def _write(args, engine: Engine, request, result, out) -> bool:
    text = engine.target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    if args.json:
        out.write(json.dumps(_result_json(args, engine, request, result, text)) + "\n")
    else:
        out.write(text + "\n")
    out.flush()
    if result.error is not None:  # one of a batch failed on its own; the others were written
        print(f"svip: error: a request failed on its own (the others went on): {result.error}", file=sys.stderr)
    return result.error is None


def _result_json(args, engine: Engine, request, result, text: str) -> dict:
    from coordinator.engine import SpeculativeEngine

    stats = result.stats.to_dict()
    distributed = args.mode == "distributed"
    stats["config"] = {
        "mode": args.mode,
        "pipeline": args.pipeline if distributed else None,
        "idle_prefill": args.idle_prefill if distributed else None,
        "draft_parallel": args.draft_parallel if distributed else None,
        "load_aware": args.load_aware,
        "target": engine.target.path,
        "draft": engine.draft_path,
        "dtype": args.dtype,
        "device": args.device,
        "max_new_tokens": request.max_new_tokens,
        "policy": _policy_json(engine.resolve(request).policy),
        "sampling": dataclasses.asdict(request.sampling),
        "emulate": args.emulate,
    }
    auto = request.policy.threshold == "auto" and isinstance(engine, SpeculativeEngine) and engine.drafter is not None
    if auto:
        stats["config"]["threshold_auto"] = engine.calibration().to_dict()
    return {
        "text": text,
        "token_ids": result.token_ids,
        "prompt_token_ids": result.prompt_ids,
        "finish_reason": result.finish_reason,
        **({"error": result.error} if result.error is not None else {}),
        **({"logprobs": [{"token": e.token, "logprob": e.logprob, "top": [list(t) for t in e.top]}
                         for e in result.logprobs]} if result.logprobs is not None else {}),
        "stats": stats,
    }


def _policy_json(policy) -> dict:
    out = dataclasses.asdict(policy)
    out.pop("oracle_tokens")
    return out
