"""Engine overhead per round: round time minus model forward time, as a share of a target forward.

    python -m svip_bench.overhead --target DIR --draft DIR [--policy svip] [--repeats 5]

Prints its command, the machine and, per policy, medians over all rounds of all repeats.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import torch

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig
from svip_common.models import load_model

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, torch threads={torch.get_num_threads()}, "
        f"python {platform.python_version()}, torch {torch.__version__}"
    )


def measure(engine: SpeculativeEngine, request: GenerationRequest, repeats: int) -> dict:
    shares, overheads, target_s, round_s = [], [], [], []
    for _ in range(repeats):
        stats = engine.generate(request).stats
        for r, d, t in zip(stats.round_s, stats.draft_forward_s, stats.target_forward_s):
            overheads.append(r - d - t)
            shares.append((r - d - t) / t)
            target_s.append(t)
            round_s.append(r)
    return {
        "rounds": len(round_s),
        "median_round_ms": 1e3 * statistics.median(round_s),
        "median_target_forward_ms": 1e3 * statistics.median(target_s),
        "median_overhead_ms": 1e3 * statistics.median(overheads),
        "median_overhead_share": statistics.median(shares),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--policy", action="append", help="repeatable; default: all drafting policies")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = load_model(args.target), load_model(args.draft)
    engine = SpeculativeEngine(target, draft, load_aware="off")  # each policy as configured
    ids = tuple(target.tokenizer(PROMPT)["input_ids"])
    print("command: python -m svip_bench.overhead " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"machine: {machine()}")
    print(f"target: {args.target} ({sum(p.numel() for p in target.model.parameters()) / 1e6:.2f}M params)")
    print(f"draft:  {args.draft} ({sum(p.numel() for p in draft.model.parameters()) / 1e6:.2f}M params)")
    print("| policy | rounds | round ms | target fwd ms | overhead ms | overhead / target fwd |")
    print("|---|---|---|---|---|---|")
    for name in args.policy or ["svip", "constant", "heuristic", "confidence"]:
        request = GenerationRequest(ids, args.max_new_tokens, policy=PolicyConfig(name=name))
        engine.generate(request)  # warm-up
        m = measure(engine, request, args.repeats)
        print(
            f"| {name} | {m['rounds']} | {m['median_round_ms']:.3f} | {m['median_target_forward_ms']:.3f} "
            f"| {m['median_overhead_ms']:.3f} | {100 * m['median_overhead_share']:.1f}% |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
