"""`svip bench --mode pipeline`: in-process vs distributed sync vs distributed async on the same
prompts, interleaved; aggregate throughput of 1 vs 8 concurrent sessions; a timeline of one
async request (draft busy, target busy, bubbles)."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from coordinator.bench.runner import Progress, encode_prompts
from coordinator.cluster import WorkerPair, init_local_ray
from coordinator.distributed import DistributedEngine
from svip_common.contracts import GenerationRequest, PolicyConfig

MODES = ("inprocess", "sync", "async")


def run(engine, prompts, args, header: dict) -> int:
    """engine: the in-process engine (its calibration gives the shared SVIP threshold)."""
    import ray

    policy = PolicyConfig(name="svip", threshold=engine.calibration().threshold)
    encoded = encode_prompts(engine, prompts, args.max_prompt_tokens)
    requests = [GenerationRequest(ids, args.max_new_tokens, policy=policy, ignore_eos=True) for ids in encoded]
    init_local_ray()
    pair = WorkerPair(engine.target.path, engine.draft_path, dtype=args.dtype, device=args.device)
    loop = asyncio.new_event_loop()
    remote = {m: DistributedEngine(pair.target_info, pair.limits, pair.target_address, pair.draft_address, m) for m in ("sync", "async")}
    for e in remote.values():
        loop.run_until_complete(e.connect())
    try:
        for r in requests[:2]:  # warm-up
            for e in remote.values():
                loop.run_until_complete(e.generate(r))
        tps, violations = _modes(engine, remote, loop, requests, args.repeats)
        concurrency = _concurrency(remote["async"], loop, requests)
        timeline = loop.run_until_complete(remote["async"].generate(requests[0])).stats
    finally:
        for e in remote.values():
            loop.run_until_complete(e.close())
        loop.close()
        pair.shutdown()
        ray.shutdown()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"header": {**header, "policy": f"svip, threshold {policy.threshold} (auto)"}, "tokens_per_s": tps,
           "concurrency": concurrency, "exactness_violations": violations,
           "timeline": timeline.timeline, "timeline_stats": {k: getattr(timeline, k) for k in (
               "wall_s", "draft_busy_s", "target_busy_s", "both_busy_s", "draft_wait_s", "target_wait_s",
               "discarded_tokens", "wire_bytes_per_round", "rounds")}}
    (out / "pipeline.json").write_text(json.dumps(doc, indent=1))
    md = _markdown(doc)
    (out / "pipeline.md").write_text(md)
    _plot_timeline(out / "timeline.png", timeline.timeline)
    print(md)
    if violations:
        print(f"EXACTNESS VIOLATIONS: {violations[:10]}", file=sys.stderr)
        return 1
    return 0


def _modes(engine, remote, loop, requests, repeats):
    per_mode = {m: [] for m in MODES}
    violations = []
    rng = random.Random(0)
    progress = Progress(len(requests) * repeats * len(MODES))
    for rep in range(repeats):
        tokens, wall = dict.fromkeys(MODES, 0), dict.fromkeys(MODES, 0.0)
        for request in requests:
            outputs = {}
            for mode in rng.sample(MODES, len(MODES)):
                if mode == "inprocess":
                    result = engine.generate(request)
                else:
                    result = loop.run_until_complete(remote[mode].generate(request))
                tokens[mode] += len(result.token_ids)
                wall[mode] += result.stats.wall_s
                outputs[mode] = result.token_ids
                progress.update(1)
            if not outputs["inprocess"] == outputs["sync"] == outputs["async"]:
                violations.append(f"repeat {rep}, prompt {request.prompt_ids[:8]}")
        for m in MODES:
            per_mode[m].append(tokens[m] / wall[m])
    base = per_mode["inprocess"]
    return {m: {"median": statistics.median(v), "min": min(v), "max": max(v),
                "ratio_to_inprocess": statistics.median([a / b for a, b in zip(v, base)]),
                "ratio_to_sync": statistics.median([a / b for a, b in zip(v, per_mode["sync"])])}
            for m, v in per_mode.items()}, violations


def _concurrency(engine: DistributedEngine, loop, requests, levels=(1, 8)) -> dict:
    out = {}
    for n in levels:
        batch = [requests[i % len(requests)] for i in range(max(n, len(requests)))]

        async def go():
            sem = asyncio.Semaphore(n)

            async def one(r):
                async with sem:
                    return await engine.generate(r)

            start = time.perf_counter()
            results = await asyncio.gather(*(one(r) for r in batch))
            return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)

        out[str(n)] = loop.run_until_complete(go())
    out["ratio"] = out[str(levels[-1])] / out[str(levels[0])]
    return out


def _markdown(doc: dict) -> str:
    h = doc["header"]
    lines = [f"Command: `{h['command']}`", f"Machine: {h['machine']}",
             f"Models: target {h['target']}, draft {h['draft']}; {h['prompts']} prompts, {h['repeats']} repeats, "
             f"{h['max_new_tokens']} new tokens, greedy, {h['policy']}", "",
             "| mode | tokens/s (min–max) | vs in-process | vs distributed sync |", "|---|---|---|---|"]
    for mode, v in doc["tokens_per_s"].items():
        lines.append(f"| {mode} | {v['median']:.1f} ({v['min']:.1f}–{v['max']:.1f}) | {v['ratio_to_inprocess']:.2f}x | {v['ratio_to_sync']:.2f}x |")
    c = doc["concurrency"]
    lines += ["", f"Async, aggregate tokens/s: 1 session {c['1']:.1f}, 8 concurrent sessions {c['8']:.1f} ({c['ratio']:.2f}x)."]
    t = doc["timeline_stats"]
    lines += ["", f"One async request: wall {t['wall_s']:.3f} s, draft busy {t['draft_busy_s']:.3f} s, target busy "
              f"{t['target_busy_s']:.3f} s, both busy {t['both_busy_s']:.3f} s, draft idle {t['draft_wait_s']:.3f} s, "
              f"target idle {t['target_wait_s']:.3f} s, {t['discarded_tokens']} pre-drafted tokens discarded, "
              f"{t['wire_bytes_per_round']:.0f} wire bytes per round."]
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
