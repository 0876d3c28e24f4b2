"""The in-process batched engine end to end: tokens/s at each batch size, target alone / svip / the defaults.

    python -m svip_bench.batched [--requests 16] [--batches 1,16] [--max-new-tokens 64] [--repeats N]
                                 [--packing | --alternate] [--json] [--head DIR|eagle]
                                 [--temperature T --top-p P] [--trees [TREE,...]]

The embedded pair (unless --target / --draft), --requests Spec-Bench prompts (their last 200
tokens), --max-new-tokens each with ignore_eos, greedy, through ``SpeculativeEngine.generate_many``
at each batch size: the target alone, SVIP at its calibrated threshold 0.4, and the defaults (no
policy: auto, with the load gate as `svip generate` runs it); with --head, a feature head at SVIP 0.3 and
the confidence stop; with --trees, SVIP's blocks as token trees too (every tree, or those named; the
head's as well).
Prints its command, the machine and
one row per policy and batch size; every output must equal the target alone's (exit 1 otherwise).
Two commits are compared by running this file against each (``PYTHONPATH=<checkout>``), alternately;
--packing compares, in one process, packed attention with one attention call per session, each
row's runs alternating between the two. --alternate reads each policy against the target alone as
a server that has run at the batch size sees it: every engine first runs one untimed pass at that
size (its load-aware estimates learn it), then the target alone and each policy alternate run by
run, --repeats rounds; a row's ratio is the median of its rounds' ratios to the target alone's run
beside it (the machine's drift cancels). --temperature (with --top-p) samples instead, request i
seeded with i: the outputs are draws, so they are not compared (tests/integration/test_sampling_exact.py
checks their distribution), and a row's "exact" is null.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from svip_bench.datasets import load_specbench, specbench_path
from svip_bench.forward_step import add_pair_args, batch_sizes, pair_dirs
from svip_bench.overhead import machine
from svip_common import kv_cache
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.models import load_model
from svip_common.trees import TREES

PROMPT_TOKENS = 200  # each prompt's last tokens


def engines(target, draft, head=None, trees: Sequence[str] = ()) -> dict:
    """head: a feature head loaded for the target (its rows: SVIP at the paper's 0.3, confidence);
    trees: SVIP's blocks as these token trees too (svip_common/trees.py), the head's as well."""
    from coordinator.engine import SpeculativeEngine

    rows = {
        "target alone": (SpeculativeEngine(target, None), PolicyConfig(name="none")),
        "svip (0.4)": (SpeculativeEngine(target, draft, load_aware="off"), PolicyConfig(name="svip", threshold=0.4)),
        "defaults": (SpeculativeEngine(target, draft), PolicyConfig()),  # every knob its default
    }
    for tree in trees:
        rows[f"svip (0.4), tree {tree}"] = (SpeculativeEngine(target, draft, load_aware="off"),
                                            PolicyConfig(name="svip", threshold=0.4, tree=tree))
    if head is not None:
        with_head = SpeculativeEngine(target, head, load_aware="off")
        rows["head: svip (0.3)"] = (with_head, PolicyConfig(name="svip", threshold=0.3))
        rows["head: confidence (0.4)"] = (with_head, PolicyConfig(name="confidence"))
        for tree in trees:
            rows[f"head: svip (0.3), tree {tree}"] = (with_head, PolicyConfig(name="svip", threshold=0.3, tree=tree))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_args(parser)
    parser.add_argument("--dataset", help="spec-bench.jsonl (default: ../shared/specbench beside the checkout)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--packing", action="store_true",
                      help="each row twice, alternating: one attention call per session, then packed attention")
    mode.add_argument("--alternate", action="store_true",
                      help="warm engines, the target alone and each policy alternating run by run: ratios to it")
    parser.add_argument("--repeats", type=int, default=1, help="runs per row (the median is printed)")
    parser.add_argument("--json", action="store_true", help="one JSON line per row instead of a table")
    parser.add_argument("--head", help="also a feature head: its directory, or 'eagle' (the embedded target's own)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sampled, seeded")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: the nucleus kept")
    parser.add_argument("--trees", nargs="?", const=",".join(TREES[1:]), default="",
                        help="also SVIP's blocks as token trees: these, comma-separated (alone: cape, auto, deep, "
                             "deep-auto)")
    args = parser.parse_args(argv)
    args.trees = [t for t in args.trees.split(",") if t]
    if any(t not in TREES[1:] for t in args.trees):
        parser.error(f"--trees takes some of {', '.join(TREES[1:])}")
    sampling = SamplingParams(args.temperature, 0, args.top_p)
    try:
        sampling.validate()
    except InvalidRequest as exc:
        parser.error(str(exc))
    if not 1 <= args.requests <= 1024 or not 1 <= args.max_new_tokens <= 4096 or not 1 <= args.repeats <= 100:
        parser.error("--requests takes 1..1024, --max-new-tokens 1..4096 and --repeats 1..100")
    batches, (target_dir, draft_dir) = batch_sizes(parser, args.batches), pair_dirs(parser, args)
    torch.set_num_threads(1)
    target, draft = load_model(target_dir), load_model(draft_dir)
    head = _head(parser, args.head, target) if args.head else None
    prompts = load_specbench(specbench_path(args.dataset), -(-args.requests // 7))[: args.requests]
    encoded = [tuple(target.tokenizer(p.text)["input_ids"])[-PROMPT_TOKENS:] for p in prompts]
    if not args.json:
        print("command: python -m svip_bench.batched " + " ".join(argv if argv is not None else sys.argv[1:]))
        print(f"machine: {machine()}")
        if args.packing:
            print("| policy | batch | one attention call per session, tokens/s | packed, tokens/s | speedup |")
            print("|---|---|---|---|---|")
        elif args.alternate:
            print("| policy | batch | tokens/s (median) | over the target alone (median of the rounds) "
                  "| tokens a round |")
            print("|---|---|---|---|---|")
        else:
            print("| policy | batch | tokens/s |")
            print("|---|---|---|")
    if args.alternate:
        return _alternated(engines(target, draft, head, args.trees), encoded, batches, sampling, args)
    greedy = sampling.greedy
    if not greedy and not args.json:
        print(f"sampled (temperature {args.temperature:g}, top-p {args.top_p:g}, request i seeded with i): "
              "draws, not compared with the target alone's")
    reference, failed = None, False
    settings = (0, kv_cache.PACK_MAX_NEW) if args.packing else (kv_cache.PACK_MAX_NEW,)
    packed = kv_cache.PACK_MAX_NEW
    for name, (engine, policy) in engines(target, draft, head, args.trees).items():
        for size in batches:
            requests = _requests(encoded, args.max_new_tokens, sampling, policy)
            runs: dict[int, list[float]] = {limit: [] for limit in settings}
            try:
                for _ in range(args.repeats):
                    for limit in settings:
                        kv_cache.PACK_MAX_NEW = limit
                        started = time.perf_counter()
                        outputs = [list(r.token_ids) for r in engine.generate_many(requests, size)]
                        runs[limit].append(sum(map(len, outputs)) / (time.perf_counter() - started))
                        reference = reference or outputs
                        failed |= greedy and outputs != reference
            finally:
                kv_cache.PACK_MAX_NEW = packed
            tps = {limit: statistics.median(v) for limit, v in runs.items()}
            if args.json:
                row = {"policy": name, "batch": size, "tokens_per_s": tps[packed],
                       "exact": not failed if greedy else None}
                if args.packing:
                    row["per_session_tokens_per_s"] = tps[0]
                print(json.dumps(row))
            elif args.packing:
                speedup = tps[packed] / tps[0]
                print(f"| {name} | {size} | {tps[0]:.1f} | {tps[packed]:.1f} | {speedup:.2f}x |", flush=True)
            else:
                print(f"| {name} | {size} | {tps[packed]:.1f} |", flush=True)
    if failed:
        print("an output differed from the target alone's", file=sys.stderr)
    return 1 if failed else 0


def _alternated(rows: dict, encoded, batches: list[int], sampling: SamplingParams, args) -> int:
    """--alternate: per batch size, every engine warmed at it, then rounds of one run each (the
    target alone first or last, alternately); every output checked against the target alone's."""
    failed, greedy = False, sampling.greedy
    for size in batches:
        def run(name):
            engine, policy = rows[name]
            requests = _requests(encoded, args.max_new_tokens, sampling, policy)
            started = time.perf_counter()
            results = engine.generate_many(requests, size)
            elapsed = time.perf_counter() - started
            outputs = [list(r.token_ids) for r in results]
            per_round = sum(map(len, outputs)) / max(1, sum(r.stats.rounds for r in results))
            return sum(map(len, outputs)) / elapsed, outputs, per_round

        for name in rows:
            run(name)  # untimed: the engine's estimates learn this batch size
        tps = {name: [] for name in rows}
        ratios = {name: [] for name in rows}
        per_round = {}
        for r in range(args.repeats):
            got = {name: run(name) for name in (list(rows) if r % 2 else list(rows)[::-1])}
            alone_tps, reference, _ = got["target alone"]
            for name, (value, outputs, settled) in got.items():
                tps[name].append(value)
                ratios[name].append(value / alone_tps)
                per_round[name] = settled  # the same every run (greedy): what a round settles
                failed |= greedy and outputs != reference
        for name in rows:
            row = {"policy": name, "batch": size, "tokens_per_s": statistics.median(tps[name]),
                   "over_alone": statistics.median(ratios[name]), "tokens_per_round": per_round[name],
                   "exact": not failed if greedy else None}
            if args.json:
                print(json.dumps(row))
            else:
                print(f"| {name} | {size} | {row['tokens_per_s']:.1f} | {row['over_alone']:.2f}x | "
                      f"{per_round[name]:.2f} |", flush=True)
    if failed:
        print("an output differed from the target alone's", file=sys.stderr)
    return 1 if failed else 0


def _requests(encoded, new_tokens: int, sampling: SamplingParams, policy: PolicyConfig) -> list[GenerationRequest]:
    """One request a prompt, as the row's policy runs it: greedy, or sampled with request i seeded with i."""
    return [GenerationRequest(ids, new_tokens, dataclasses.replace(sampling, seed=i), policy, ignore_eos=True)
            for i, ids in enumerate(encoded)]


def _head(parser, head: str, target):
    from draft_worker.feature_draft import load_feature_draft
    from svip_assets import head_path
    from svip_common.errors import ModelLoadError

    path = head_path(head)
    if path is None:
        parser.error(f"--head: {head!r} holds no feature head")
    try:
        return load_feature_draft(path, target)
    except ModelLoadError as exc:
        parser.error(f"--head: {exc}")


if __name__ == "__main__":
    raise SystemExit(main())
