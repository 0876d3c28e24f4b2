"""One pooled forward, timed and counted: what the engine step costs at a batch size and a context.

    python -m svip_bench.forward_step [--batches 1,16] [--context 200] [--repeats 30] [--packing | --decoder]

For each model of the pair (the embedded one unless --target / --draft), each batch size and each
step shape (decode: one new token per session, as a draft step; verify: five, as a target step):
B sessions in a pool of a worker's default size, prefilled and decoded together up to a context
of --context tokens (as on a worker serving them), then the step is run --repeats times (each
followed by a rollback, so the context stays put). Prints its command, the machine, the median
and p90 of the forward's wall time, the number of aten operators one forward runs
(torch.profiler) and how many sessions hold one run of pages. Nothing here changes the engine: it
reads ``KVPool.forward`` as the workers call it, so two commits are compared by running this file
against each (``PYTHONPATH=<checkout>``), alternately. --packing instead compares, in one process
on the same sessions, packed attention (the step's short items in one SDPA call per layer) with one
call per session, alternating step by step; --decoder compares the pool's flat decoder
(svip_common/pool_decoder.py) with the model's own modules the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from svip_assets import default_pair
from svip_bench.overhead import machine
from svip_common import kv_cache
from svip_common.kv_cache import KVPool
from svip_common.kv_sizes import DEFAULT_KV_TOKENS
from svip_common.models import load_model

SHAPES = {"decode": 1, "verify": 5}


def sessions(pool: KVPool, batch: int, context: int, vocab: int) -> list:
    """B sequences holding ``context`` tokens each, prefilled and grown side by side."""
    g = torch.Generator().manual_seed(0)
    seqs = [pool.sequence() for _ in range(batch)]
    prompt = context // 2
    ids = [torch.randint(1, vocab, (context,), generator=g).tolist() for _ in range(batch)]
    pool.forward([(s, row[:prompt], 1) for s, row in zip(seqs, ids)])
    for i in range(prompt, context):  # decoded together, as a worker's sessions grow
        pool.forward([(s, [row[i]], 1) for s, row in zip(seqs, ids)])
    return seqs


def worker_pool(model, batch: int, context: int) -> tuple[KVPool, list]:
    """A pool of a worker's default size (or more, for the batch) and its B prefilled sessions."""
    pool = KVPool(model.model, tokens=max(DEFAULT_KV_TOKENS, batch * (context + 64)))
    return pool, sessions(pool, batch, context, model.token_limit)


def step(pool: KVPool, seqs: list, new: int) -> float:
    steps = [(s, list(range(7, 7 + new)), new) for s in seqs]
    lengths = [len(s) for s in seqs]
    started = time.perf_counter()
    pool.forward(steps)
    elapsed = time.perf_counter() - started
    for s, n in zip(seqs, lengths):
        s.rollback(n)
    return elapsed


def aten_ops(pool: KVPool, seqs: list, new: int) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(pool, seqs, new)
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def measure(model, batch: int, context: int, repeats: int) -> list[dict]:
    pool, seqs = worker_pool(model, batch, context)
    rows = []
    for shape, new in SHAPES.items():
        for _ in range(3):
            step(pool, seqs, new)  # warm-up
        times = sorted(step(pool, seqs, new) for _ in range(repeats))
        rows.append({
            "batch": batch, "shape": shape, "new_tokens": new, "context": context,
            "median_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))],
            "aten_ops": aten_ops(pool, seqs, new),
            "runs": sum(s.one_run for s in seqs),
        })
    return rows


def alternate(pool: KVPool, seqs: list, new: int, repeats: int, ways: dict) -> dict:
    """Median seconds and aten operators of one step under each way (name -> a function that
    sets the pool up for it), alternating step by step after a warm-up of three each."""
    times = {name: [] for name in ways}
    names = list(ways)
    for r in range(3 + repeats):
        for name in (names if r % 2 else names[::-1]):
            ways[name]()
            elapsed = step(pool, seqs, new)
            if r >= 3:
                times[name].append(elapsed)
    ops = {}
    for name, setup in ways.items():
        setup()
        ops[name] = aten_ops(pool, seqs, new)
    return {name: (statistics.median(times[name]), ops[name]) for name in ways}


def compared(pool: KVPool, seqs: list, batch: int, context: int, repeats: int, ways: dict) -> list[dict]:
    """One row per step shape for two ways (before, after: name -> setup), alternated: each one's
    median ms and aten operators, and the speedup of the second over the first."""
    (before, _), (after, _) = ways.items()
    rows = []
    for shape, new in SHAPES.items():
        got = alternate(pool, seqs, new, repeats, ways)
        (slow, slow_ops), (fast, fast_ops) = got[before], got[after]
        rows.append({
            "batch": batch, "shape": shape, "new_tokens": new, "context": context,
            f"{before}_ms": 1e3 * slow, f"{after}_ms": 1e3 * fast, "speedup": slow / fast,
            f"{before}_ops": slow_ops, f"{after}_ops": fast_ops,
        })
    return rows


def measure_decoder(model, batch: int, context: int, repeats: int) -> list[dict]:
    """The pool's flat decoder against the model's own modules, in one process on the same
    sessions, alternating step by step."""
    pool, seqs = worker_pool(model, batch, context)
    decoder = pool.decoder
    if decoder is None:
        raise SystemExit(f"{model.path}: the flat decoder does not know this model's layout")

    def through(d):
        return lambda: setattr(pool, "decoder", d)

    try:
        return compared(pool, seqs, batch, context, repeats, {"modules": through(None), "flat": through(decoder)})
    finally:
        pool.decoder = decoder


def measure_packing(model, batch: int, context: int, repeats: int) -> list[dict]:
    """Packed attention (a step's short items in one SDPA call per layer) against one call per
    session, in one process on the same sessions, alternating step by step (the machine's drift
    falls on both alike)."""
    pool, seqs = worker_pool(model, batch, context)
    packed = kv_cache.PACK_MAX_NEW

    def limit(value):
        return lambda: setattr(kv_cache, "PACK_MAX_NEW", value)

    try:
        return compared(pool, seqs, batch, context, repeats, {"per_session": limit(0), "packed": limit(packed)})
    finally:
        kv_cache.PACK_MAX_NEW = packed


def add_pair_args(parser: argparse.ArgumentParser) -> None:
    """--target / --draft (both, or neither: the embedded pair) and --batches, as these benches take them."""
    parser.add_argument("--target", help="model directory (with --draft; default: the embedded pair)")
    parser.add_argument("--draft", help="model directory (with --target)")
    parser.add_argument("--batches", default="1,16", help="batch sizes, comma-separated")


def pair_dirs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, str]:
    if bool(args.target) != bool(args.draft):
        parser.error("give --target and --draft together, or neither (the embedded pair)")
    return (args.target, args.draft) if args.target else default_pair()


def batch_sizes(parser: argparse.ArgumentParser, text: str) -> list[int]:
    sizes = [s.strip() for s in text.split(",")]
    if not all(s.isdigit() and 1 <= int(s) <= 4096 for s in sizes):
        parser.error(f"--batches takes batch sizes from 1 to 4096, comma-separated (1,16), got {text!r}")
    return [int(s) for s in sizes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_args(parser)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    way = parser.add_mutually_exclusive_group()
    way.add_argument("--packing", action="store_true",
                     help="packed attention against one SDPA call per session, alternating in one process")
    way.add_argument("--decoder", action="store_true",
                     help="the pool's flat decoder against the model's own modules, alternating in one process")
    parser.add_argument("--json", action="store_true", help="one JSON line per row instead of a table")
    args = parser.parse_args(argv)
    if args.context < 2 or args.repeats < 1:
        parser.error("--context must be at least 2 and --repeats at least 1")
    batches, (target_dir, draft_dir) = batch_sizes(parser, args.batches), pair_dirs(parser, args)
    torch.set_num_threads(args.threads)
    if not args.json:
        print("command: python -m svip_bench.forward_step " + " ".join(argv if argv is not None else sys.argv[1:]))
        print(f"machine: {machine()}")
        if args.packing:
            print("| model | batch | step | one call per session, median ms | packed, median ms | speedup "
                  "| aten ops, per session | packed |")
            print("|---|---|---|---|---|---|---|---|")
        elif args.decoder:
            print("| model | batch | step | modules, median ms | flat decoder, median ms | speedup "
                  "| aten ops, modules | flat decoder |")
            print("|---|---|---|---|---|---|---|---|")
        else:
            print("| model | batch | step | median ms | p90 ms | aten ops | sessions held as one run |")
            print("|---|---|---|---|---|---|---|")
    for name, path in (("target", target_dir), ("draft", draft_dir)):
        model = load_model(path)
        for batch in batches:
            run = measure_packing if args.packing else measure_decoder if args.decoder else measure
            for row in run(model, batch, args.context, args.repeats):
                row["model"] = name
                if args.json:
                    print(json.dumps(row), flush=True)
                elif args.packing:
                    print(f"| {name} | {batch} | {row['shape']} | {row['per_session_ms']:.2f} | {row['packed_ms']:.2f} "
                          f"| {row['speedup']:.2f}x | {row['per_session_ops']} | {row['packed_ops']} |", flush=True)
                elif args.decoder:
                    print(f"| {name} | {batch} | {row['shape']} | {row['modules_ms']:.2f} | {row['flat_ms']:.2f} "
                          f"| {row['speedup']:.2f}x | {row['modules_ops']} | {row['flat_ops']} |", flush=True)
                else:
                    print(f"| {name} | {batch} | {row['shape']} | {row['median_ms']:.2f} | {row['p90_ms']:.2f} "
                          f"| {row['aten_ops']} | {row['runs']} of {batch} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
