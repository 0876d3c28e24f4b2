"""`svip bench --mode pipeline`: the target alone and the in-process engine against distributed
sync and distributed async, on the same prompts, interleaved (every output must equal the target
alone's); each distributed mode's round broken down (draft and target forwards on the critical
path, block and feedback transit, queueing, overhead), where async's blocks came from (ready at
the verdict or drafted after it) and the bound async could reach (sync's rounds with the draft
and the round trip hidden after every full acceptance); 1, 8 and 16 sessions in flight, async
SVIP and the target alone through the same workers (the Serve bench's ratio without HTTP and
Serve); one async request's timeline; and, with --latencies, sync vs async across two nodes with that round-trip
latency on the link between them (svip_bench/two_nodes.py). --one-core-each gives each model a
core of its own as its device (Linux CPU affinity): the target alone and the in-process engine run
on core 0, the distributed target on core 0 and its draft on core 1, so the distributed pipeline
is measured as two devices against one."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from coordinator.cluster import WorkerPair, init_local_ray
from coordinator.distributed import DistributedEngine
from svip_bench.runner import Progress, encode_prompts, nearest_rank
from svip_common.contracts import ROUND_PARTS, GenerationRequest, GenerationStats, PolicyConfig
from svip_common.emulation import Emulation, parse_emulation

MODES = ("alone", "inprocess", "sync", "async")  # alone: the target alone, in process
MODE_NAMES = {"alone": "target alone (in process)", "inprocess": "in-process", "sync": "distributed sync",
              "async": "distributed async"}



def run(engine, prompts, args, header: dict) -> int:
    """engine: the in-process engine (its calibration gives the shared SVIP threshold, a feature
    head's drafted on its own blocks, unless --svip-threshold gives one)."""
    given = args.svip_threshold
    if given is not None:
        threshold, source = given, "given"
    else:
        threshold, source = engine.calibration().threshold, "auto"
    policy = PolicyConfig(name="svip", threshold=threshold)
    policy.validate()
    header["svip_threshold"] = threshold
    encoded = encode_prompts(engine, prompts, args.max_prompt_tokens)
    requests = [GenerationRequest(ids, args.max_new_tokens, policy=policy, ignore_eos=True) for ids in encoded]
    init_local_ray()  # before ray is imported here: the local cluster stays on 127.0.0.1
    import ray

    header["load_aware"], header["idle_prefill"] = engine.config.load_aware, engine.config.idle_prefill
    spec = args.emulate_spec  # device timing: the workers' GPUs each, in process the target's
    emulation = None if spec is None else parse_emulation(spec)
    if emulation is not None:
        header["emulated"] = f"{emulation.describe()} (distributed: a device each; in process: " \
                             f"{emulation.co_located().describe()}, one device)"
    pair = WorkerPair(engine.config.replace(emulate=spec))  # the in-process engine's knobs, on the workers
    cores = one_core_each(pair) if args.one_core_each else None
    if cores is not None:
        header["cores"] = "target alone and in-process on core 0; target worker on core 0, draft worker on core 1"
    loop = asyncio.new_event_loop()
    remote = {m: DistributedEngine.for_pair(pair, m) for m in ("sync", "async")}
    for e in remote.values():
        loop.run_until_complete(e.connect())
    try:
        for r in requests[:2]:  # warm-up
            for e in remote.values():
                loop.run_until_complete(e.generate(r))
        tps, stats, violations, ttft = _modes(engine, remote, loop, requests, args.repeats, cores,
                                              None if emulation is None else emulation.co_located())
        concurrency, crowd_violations = _concurrency(remote["async"], loop, requests, args.repeats)
        violations += crowd_violations
        timeline = loop.run_until_complete(remote["async"].generate(requests[0])).stats
    finally:
        for e in remote.values():
            loop.run_until_complete(e.close())
        loop.close()
        pair.shutdown()
        ray.shutdown()
    doc = {"header": {**header, "policy": f"svip, threshold {policy.threshold} ({source})"}, "tokens_per_s": tps,
           "breakdown": {m: breakdown(s) for m, s in stats.items()}, "ttft_ms": ttft,
           "sources": {m: sources(s) for m, s in stats.items()},
           "prepared_continuations": prepared_continuations(stats["async"]),
           "async_bound": async_bound(stats["sync"], tps["sync"]["median"]),
           "wire_bytes_per_round": {m: wire_bytes(s) for m, s in stats.items()},
           "concurrency": concurrency, "exactness_violations": violations,
           "timeline": timeline.timeline, "timeline_stats": {k: getattr(timeline, k) for k in (
               "wall_s", "draft_busy_s", "target_busy_s", "both_busy_s", "draft_wait_s", "target_wait_s",
               "discarded_tokens", "wire_bytes_per_round", "rounds", "prepared_sent", "prepared_used")}}
    latencies = [float(x) for x in args.latencies.split(",")] if args.latencies else []
    if latencies:
        doc["two_nodes"] = two_nodes(engine, requests, latencies, args.repeats)
        violations += [v for row in doc["two_nodes"] for v in row["violations"]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.json").write_text(json.dumps(doc, indent=1))
    md = _markdown(doc)
    (out / "pipeline.md").write_text(md)
    _plot_timeline(out / "timeline.png", timeline.timeline)
    print(md)
    if violations:
        print(f"EXACTNESS VIOLATIONS: {violations[:10]}", file=sys.stderr)
        return 1
    return 0


def one_core_each(pair: WorkerPair) -> dict[str, set[int]]:
    """Pin the target worker's threads to core 0 and the draft worker's to core 1 (threads they
    start later inherit it); returns the cores this process runs each mode on."""
    available = os.sched_getaffinity(0)
    if not {0, 1} <= available:
        raise SystemExit(f"--one-core-each needs cores 0 and 1; this process may run on {sorted(available)}")
    for role, pid in pair.pids().items():
        _pin_process(pid, {0} if role == "target" else {1})
    return {"alone": {0}, "inprocess": {0}, "sync": available, "async": available}


def _pin_process(pid: int, cores: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


@contextlib.contextmanager
def _on_cores(cores: set[int] | None):
    """This thread (it runs the in-process forwards) on these cores for the block (None: as it is)."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _modes(engine, remote, loop, requests, repeats, cores: dict[str, set[int]] | None = None,
           emulation: Emulation | None = None):
    """cores: per mode, where this process's compute runs (None: wherever the OS puts it);
    emulation: device timing in process (the draft on the target's devices), None: as the models run."""
    from coordinator.engine import SpeculativeEngine

    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    alone = SpeculativeEngine(engine.target, None, kv_cache_tokens=longest)  # one request at a time: a pool its size
    if emulation is not None:
        engine.time_as(emulation)
        alone.time_as(emulation)
    try:
        return _timed_modes(engine, alone, remote, loop, requests, repeats, cores)
    finally:
        engine.time_as(None)


def _timed_modes(engine, alone, remote, loop, requests, repeats, cores):
    per_mode = {m: [] for m in MODES}
    stats: dict[str, list[GenerationStats]] = {m: [] for m in ("sync", "async")}
    first_ms: dict[str, list[float]] = {m: [] for m in ("sync", "async")}  # time to the first settled token
    violations = []
    rng = random.Random(0)
    progress = Progress(len(requests) * repeats * len(MODES))
    for rep in range(repeats):
        tokens, wall = dict.fromkeys(MODES, 0), dict.fromkeys(MODES, 0.0)
        for request in requests:
            outputs = {}
            for mode in rng.sample(MODES, len(MODES)):
                with _on_cores(None if cores is None else cores[mode]):
                    if mode == "alone":
                        result = alone.generate(dataclasses.replace(request, policy=PolicyConfig(name="none")))
                    elif mode == "inprocess":
                        result = engine.generate(request)
                    else:
                        result, ms = _streamed(loop, remote[mode], request)
                        stats[mode].append(result.stats)
                        first_ms[mode].append(ms)
                tokens[mode] += len(result.token_ids)
                wall[mode] += result.stats.wall_s
                outputs[mode] = result.token_ids
                progress.update(1)
            if not outputs["alone"] == outputs["inprocess"] == outputs["sync"] == outputs["async"]:
                violations.append(f"repeat {rep}, prompt {request.prompt_ids[:8]}")
        for m in MODES:
            per_mode[m].append(tokens[m] / wall[m])
    ttft = {m: {"median_ms": statistics.median(v), "p95_ms": nearest_rank(v, 0.95)} for m, v in first_ms.items()}
    return _ratios(per_mode, "inprocess"), stats, violations, ttft


def _streamed(loop, engine, request: GenerationRequest) -> tuple:
    """The request through a distributed engine, and the time to its first settled token (ms)."""
    first: list[float] = []

    def arrived(tokens: list[int], logprobs: list) -> bool:
        first.append(time.perf_counter())
        return False  # never a stop here

    started = time.perf_counter()
    result = loop.run_until_complete(engine.generate(request, arrived))
    return result, 1e3 * (first[0] - started) if first else float("nan")


def _ratios(per_mode: dict[str, list[float]], base: str) -> dict:
    """Median tokens/s per mode and the median of the per-repeat ratios to `base`, to sync and
    (when it ran) to the target alone."""
    def ratio(v, to):
        return statistics.median([a / b for a, b in zip(v, per_mode[to])])

    return {m: {"median": statistics.median(v), "min": min(v), "max": max(v),
                "ratio_to_base": ratio(v, base), "ratio_to_sync": ratio(v, "sync"),
                **({"ratio_to_alone": ratio(v, "alone")} if "alone" in per_mode else {})}
            for m, v in per_mode.items()}


def breakdown(stats: list[GenerationStats]) -> dict:
    """Per round, median and mean of each part, in ms, over every round of every request."""
    out = {}
    for key in ("round_s", *ROUND_PARTS):
        values = [x for s in stats for x in getattr(s, key)]
        out[key] = {"median_ms": 1e3 * statistics.median(values), "mean_ms": 1e3 * statistics.mean(values)}
    return out


def wire_bytes(stats: list[GenerationStats]) -> dict:
    """Bytes on the draft link per round (both directions: blocks, feedback, and a feature draft's
    features), each request's mean: median and p95 over the requests."""
    values = [s.wire_bytes_per_round for s in stats if s.rounds]
    if not values:
        return {"median": 0.0, "p95": 0.0}
    return {"median": statistics.median(values), "p95": nearest_rank(values, 0.95)}


def sources(stats: list[GenerationStats]) -> dict:
    """A mode's rounds by where their block came from: count, mean wall and overhead (ms)."""
    rows = collections.defaultdict(list)
    for s in stats:
        for i, source in enumerate(s.round_sources):
            rows[source].append((s.round_s[i], s.overhead_s[i], s.target_forward_s[i], s.draft_lengths[i],
                                 s.accepted_lengths[i]))
    total = sum(len(v) for v in rows.values())
    out = {
        k: {
            "rounds": len(v),
            "share": len(v) / total,
            "wall_ms": 1e3 * statistics.mean(r[0] for r in v),
            "overhead_ms": 1e3 * statistics.mean(r[1] for r in v),
            "target_ms": 1e3 * statistics.mean(r[2] for r in v),
            "drafted": statistics.mean(r[3] for r in v),
            "accepted": statistics.mean(r[4] for r in v),
        }
        for k, v in sorted(rows.items())
    }
    return out


def prepared_continuations(stats: list[GenerationStats]) -> dict:
    return {
        "sent": sum(s.prepared_sent for s in stats),
        "used": sum(s.prepared_used for s in stats),
        "used_late": sum(s.prepared_used_late for s in stats),
    }


def async_bound(sync: list[GenerationStats], sync_tps: float) -> dict:
    """What async could reach with sync's own measured rounds: after every fully accepted round
    the next block's drafting and the round trip are hidden (the follow-up is already at the
    target); after a rejection they are not."""
    wall = hidden = 0.0
    for s in sync:
        full = [a == d and d > 0 for a, d in zip(s.accepted_lengths, s.draft_lengths)]
        for i in range(s.rounds):
            wall += s.round_s[i]
            if i and full[i - 1]:
                hidden += s.draft_forward_s[i] + s.overhead_s[i]
    speedup = wall / (wall - hidden) if wall > hidden else float("inf")
    return {"speedup_over_sync": speedup, "tokens_per_s": sync_tps * speedup}


CONCURRENCY = (1, 8, 16)  # sessions in flight at once (the Serve bench's client levels)


def _concurrency(engine: DistributedEngine, loop, requests, repeats: int = 1,
                 levels=CONCURRENCY) -> tuple[dict, list[str]]:
    """Aggregate tokens/s with n sessions in flight (at least every prompt once), async SVIP and
    the target alone through the same workers (policy none), alternating which goes first, the
    median of ``repeats`` runs each: the Serve bench's ratio without HTTP and Serve, so a loss
    there can be placed. Every output checked against the target alone's."""
    runs: dict = {"svip": {}, "none": {}}
    violations = []
    for n in levels:
        batch = [requests[i % len(requests)] for i in range(max(n, len(requests)))]
        alone = [dataclasses.replace(r, policy=PolicyConfig(name="none")) for r in batch]
        for rep in range(repeats):
            outputs = {}
            for policy in ("svip", "none") if rep % 2 else ("none", "svip"):
                tps, outputs[policy] = loop.run_until_complete(_crowd(engine, batch if policy == "svip" else alone, n))
                runs[policy].setdefault(str(n), []).append(tps)
            violations += [f"concurrency {n}, repeat {rep}, prompt {r.prompt_ids[:8]}" for r, a, b in
                           zip(batch, outputs["svip"], outputs["none"]) if a != b]
    return {p: {n: statistics.median(v) for n, v in by_n.items()} for p, by_n in runs.items()}, violations


async def _crowd(engine: DistributedEngine, requests, n: int) -> tuple[float, list[list[int]]]:
    """The requests with at most n in flight: aggregate tokens/s and each one's tokens."""
    sem = asyncio.Semaphore(n)

    async def one(r):
        async with sem:
            return await engine.generate(r)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(r) for r in requests))
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start), [r.token_ids for r in results]


def two_nodes(engine, requests: list[GenerationRequest], latencies: list[float], repeats: int) -> list[dict]:
    """Sync vs async with the draft and the target on two nodes (network namespaces), for each
    round-trip latency on the link between them; outputs checked against the in-process engine."""
    from svip_bench.two_nodes import TwoNodes, unavailable

    if (why := unavailable()) is not None:
        print(f"bench: two-node runs skipped: {why}", file=sys.stderr)
        return []
    expected = [engine.generate(r).token_ids for r in requests]
    # plaintext between the two namespaces this bench makes and tears down (the TLS cost is measured
    # by tests/integration/test_two_nodes.py); a real cluster gets --grpc-tls-dir
    spec = {
        "target": engine.target.path,
        "draft": engine.draft_path,
        "layout": "spread",
        "modes": ["sync", "async"],
        "repeats": repeats,
        "warmup": 1,
        "insecure_workers": True,
        "requests": [
            {
                "prompt_ids": list(r.prompt_ids),
                "max_new_tokens": r.max_new_tokens,
                "ignore_eos": True,
                "policy": {"name": "svip", "threshold": r.policy.threshold},
            }
            for r in requests
        ],
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        for latency in latencies:
            with TwoNodes(delay_ms=latency) as nodes:
                done = nodes.run(
                    [sys.executable, "-m", "svip_bench.cluster_run", str(Path(tmp) / "spec.json")], timeout=3600
                )
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"two-node run at {latency} ms failed: {done.stderr[-2000:]}")
            result = json.loads(line[len("RESULT ") :])
            per_mode = {}
            for mode in ("sync", "async"):
                per_repeat = [
                    result["stats"][mode][i : i + len(requests)]
                    for i in range(0, len(result["stats"][mode]), len(requests))
                ]
                per_mode[mode] = [
                    sum(len(o) for o in result["outputs"][mode][i : i + len(requests)])
                    / sum(s["wall_s"] for s in chunk)
                    for i, chunk in zip(range(0, len(result["outputs"][mode]), len(requests)), per_repeat)
                ]
            violations = [
                f"{latency} ms {mode}" for mode in ("sync", "async") if result["outputs"][mode] != expected * repeats
            ]
            rows.append(
                {"latency_ms": latency, "link": nodes.how, **_ratios(per_mode, "sync"), "violations": violations}
            )
    return rows


def _markdown(doc: dict) -> str:
    h = doc["header"]
    lines = [
        f"Command: `{h['command']}`",
        f"Machine: {h['machine']}" + (f"; one core each: {h['cores']}" if "cores" in h else ""),
        f"Models: target {h['target']}, draft {h['draft']}; {h['prompts']} prompts, {h['repeats']} repeats, "
        f"{h['max_new_tokens']} new tokens, greedy, {h['policy']}, load-aware {h.get('load_aware', 'greedy')}, "
        f"idle prefill {h.get('idle_prefill', 'off')}",
        *([f"Device timing: {h['emulated']}"] if "emulated" in h else []),
        "",
        "| mode | tokens/s (min–max) | vs the target alone | vs in-process | vs distributed sync |",
        "|---|---|---|---|---|",
    ]
    for mode, v in doc["tokens_per_s"].items():
        lines.append(
            f"| {MODE_NAMES[mode]} | {v['median']:.1f} ({v['min']:.1f}–{v['max']:.1f}) | {v['ratio_to_alone']:.2f}x "
            f"| {v['ratio_to_base']:.2f}x | {v['ratio_to_sync']:.2f}x |"
        )
    b = doc["async_bound"]
    lines += [
        "",
        f"Async bound from sync's own rounds (drafting and the round trip hidden after each full acceptance): "
        f"{b['tokens_per_s']:.1f} tokens/s, {b['speedup_over_sync']:.2f}x sync; async reached "
        f"{doc['tokens_per_s']['async']['median'] / b['tokens_per_s']:.0%} of it.",
        "",
        "Per round, median (mean) in ms:",
        "",
        "| part | " + " | ".join(doc["breakdown"]) + " |",
        "|---|" + "---|" * len(doc["breakdown"]),
    ]
    for part in ("round_s", *ROUND_PARTS):
        cells = [f"{v[part]['median_ms']:.3f} ({v[part]['mean_ms']:.3f})" for v in doc["breakdown"].values()]
        lines.append(f"| {part.removesuffix('_s').replace('_', ' ')} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Rounds by where the block came from (async's followup, prepared: ready at the verdict, no round trip; "
        "paused: the target alone while load-aware speculation pauses the draft; filled: the target's own token "
        "while the session waited on its block):",
        "",
        "| mode | source | rounds | share | drafted | accepted | wall ms | target ms | overhead ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, rows in doc["sources"].items():
        for name, v in rows.items():
            lines.append(
                f"| {mode} | {name} | {v['rounds']} | {v['share']:.0%} | {v['drafted']:.2f} | {v['accepted']:.2f} "
                f"| {v['wall_ms']:.2f} | {v['target_ms']:.2f} | {v['overhead_ms']:.2f} |"
            )
    prepared = doc["prepared_continuations"]
    lines += [
        "",
        f"Prepared continuations: {prepared['sent']} reached the target in time, {prepared['used']} verified "
        f"with no round trip, {prepared['used_late']} sent again by the draft after the verdict.",
    ]
    w = doc.get("wire_bytes_per_round", {})
    if w:
        lines += ["", "Wire bytes per round (each request's mean; median and p95 over requests): "
                  + ", ".join(f"{m} {v['median']:.0f} / {v['p95']:.0f}" for m, v in w.items()) + "."]
    f = doc.get("ttft_ms", {})
    if f:
        lines += ["", "Time to the first token streamed (one request at a time; median / p95 ms): "
                  + ", ".join(f"{m} {v['median_ms']:.1f} / {v['p95_ms']:.1f}" for m, v in f.items()) + "."]
    c = doc["concurrency"]
    first = min(c["svip"], key=int)
    lines += ["", "Sessions in flight at once, aggregate tokens/s through the workers (async; the target alone is "
              "policy none on the same workers; medians of the repeats, alternating):", "",
              "| sessions | SVIP | over 1 session | the target alone | over 1 session | SVIP / alone |",
              "|---|---|---|---|---|---|"]
    for n in c["svip"]:
        svip, alone = c["svip"][n], c["none"][n]
        lines.append(f"| {n} | {svip:.1f} | {svip / c['svip'][first]:.2f}x | {alone:.1f} "
                     f"| {alone / c['none'][first]:.2f}x | {svip / alone:.2f}x |")
    t = doc["timeline_stats"]
    lines += [
        "",
        f"One async request: wall {t['wall_s']:.3f} s, draft busy {t['draft_busy_s']:.3f} s, target busy "
        f"{t['target_busy_s']:.3f} s, both busy {t['both_busy_s']:.3f} s, draft idle {t['draft_wait_s']:.3f} s, "
        f"target idle {t['target_wait_s']:.3f} s, {t['discarded_tokens']} pre-drafted tokens discarded, "
        f"{t['wire_bytes_per_round']:.0f} wire bytes per round.",
    ]
    if doc.get("two_nodes"):
        lines += [
            "",
            "Two nodes (network namespaces), round-trip latency on the link:",
            "",
            "| latency | link | sync tokens/s | async tokens/s | async vs sync |",
            "|---|---|---|---|---|",
        ]
        for row in doc["two_nodes"]:
            lines.append(
                f"| {row['latency_ms']:g} ms | {row['link']} | {row['sync']['median']:.1f} | "
                f"{row['async']['median']:.1f} | {row['async']['ratio_to_sync']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def _plot_timeline(path: Path, timeline) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 2.6))
    for row, worker, color in ((1, "draft", "tab:blue"), (0, "target", "tab:orange")):
        spans = [(a, b - a) for w, a, b in timeline if w == worker]
        ax.broken_barh(spans, (row - 0.35, 0.7), color=color)
    ax.set_yticks([0, 1], ["target", "draft"])
    ax.set_xlabel("seconds since the request started (white: idle, a bubble)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
