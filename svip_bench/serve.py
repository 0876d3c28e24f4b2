"""`svip bench --mode serve`: the whole serving stack under load. The Serve app runs on this
machine (`svip serve`'s start()); streaming clients send the same prompts over HTTP at rising
concurrency with each of --serve-policies (defaults: what a request with no policy gets; svip at
the pair's calibrated threshold; none: the target alone on the same pipeline; confidence;
constant-K), interleaved and shuffled per repeat. Reports aggregate tokens/s, time to first token
and request latency, and
checks that every output equals the in-process engine's greedy output. Then the in-process batched
engine (`svip generate --batch-size`): the same prompts, BATCH requests at a time against one at
a time, svip and the target alone, interleaved."""

from __future__ import annotations

import json
import random
import socket
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from svip_bench.runner import Progress, encode_prompts, nearest_rank, write_results
from svip_common.contracts import GenerationRequest, PolicyConfig
from svip_common.errors import InvalidRequest

POLICIES = ("svip", "none")  # the in-process batched comparison
BATCH = 16  # in-process: requests in flight at once, against 1


def run(engine, prompts, args, header: dict) -> int:
    import httpx

    from svip_serve import local
    from svip_serve.settings import ServeSettings

    threshold = engine.calibration().threshold
    policies, levels = parse_policies(args.serve_policies), parse_levels(args.levels)
    encoded = encode_prompts(engine, prompts, args.max_prompt_tokens)
    reference = [
        engine.generate(
            GenerationRequest(ids, args.max_new_tokens, ignore_eos=True, policy=PolicyConfig(name="none"))
        ).token_ids
        for ids in encoded
    ]
    inprocess = _inprocess_tps(engine, encoded, args.max_new_tokens, threshold)
    texts = [engine.target.tokenizer.decode(r, skip_special_tokens=True) for r in reference]
    port = _free_port()
    settings = ServeSettings(
        target=engine.target.path,
        draft=engine.draft_path,
        dtype=args.dtype,
        model_name="bench",
        max_in_flight=max(levels),
        max_waiting=max(levels),
        allow_ignore_eos=True,
        idle_prefill=args.idle_prefill,
    )
    header["idle_prefill"] = settings.idle_prefill
    base = local.start(settings, port=port)
    client = httpx.Client(timeout=600)
    try:
        for ids in encoded[:2]:  # warm-up
            _stream(client, base, ids, 8, "svip", threshold)
        results, violations = _levels(client, base, encoded, texts, args, threshold, policies, levels)
    finally:
        client.close()
        local.stop()
    batched, batch_violations = _inprocess_batches(engine, encoded, reference, args, threshold)
    violations += batch_violations
    doc = {
        "header": {**header, "threshold": threshold, "levels": levels, "policies": policies},
        "inprocess_tokens_per_s": inprocess,
        "results": results,
        "inprocess_batches": batched,
        "exactness_violations": violations,
    }
    status = write_results(Path(args.out), "serve", doc, _markdown(doc))
    _plot(Path(args.out) / "serve.png", results, levels)
    return status


def _inprocess_tps(engine, encoded, max_new: int, threshold: float) -> float:
    tokens = wall = 0.0
    for ids in encoded:
        r = engine.generate(GenerationRequest(ids, max_new, ignore_eos=True, policy=PolicyConfig()))
        tokens, wall = tokens + len(r.token_ids), wall + r.stats.wall_s
    return tokens / wall


def _inprocess_batches(engine, encoded, reference, args, threshold: float):
    """Aggregate tokens/s of BATCH requests (the prompts, repeated) through the batched engine
    (load-aware, as `svip generate` runs it) at batch size 1 and BATCH, svip and none, interleaved."""
    from coordinator.engine import SpeculativeEngine

    batched = SpeculativeEngine(engine.target, engine.drafter.draft)  # the defaults, as svip generate runs
    picks = [i % len(encoded) for i in range(BATCH)]
    runs = {(b, p): [] for b in (1, BATCH) for p in POLICIES}
    violations, rng = [], random.Random(1)
    for rep in range(args.repeats):
        for key in rng.sample(list(runs), len(runs)):
            size, policy = key
            requests = [
                GenerationRequest(
                    encoded[i],
                    args.max_new_tokens,
                    ignore_eos=True,
                    policy=PolicyConfig(name=policy, threshold=threshold),
                )
                for i in picks
            ]
            start = time.perf_counter()
            results = batched.generate_many(requests, size)
            wall = time.perf_counter() - start
            violations += [
                f"in-process batch {size}, {policy}, prompt {i}"
                for i, r in zip(picks, results)
                if r.token_ids != reference[i]
            ]
            runs[key].append(
                {
                    "tps": sum(len(r.token_ids) for r in results) / wall,
                    "pauses": sum(r.stats.pauses for r in results),
                    "draft_tokens": sum(r.stats.draft_tokens for r in results),
                }
            )
    rows = []
    for (size, policy), reps in runs.items():
        tps = [r["tps"] for r in reps]
        rows.append(
            {
                "batch_size": size,
                "policy": policy,
                "tokens_per_s": statistics.median(tps),
                "tokens_per_s_min": min(tps),
                "tokens_per_s_max": max(tps),
                "over_batch_1": statistics.median([a["tps"] / b["tps"] for a, b in zip(reps, runs[(1, policy)])]),
                "svip_over_none": statistics.median(
                    [a["tps"] / b["tps"] for a, b in zip(runs[(size, "svip")], runs[(size, "none")])]
                ),
                "pauses": statistics.median(r["pauses"] for r in reps),
                "draft_tokens": statistics.median(r["draft_tokens"] for r in reps),
            }
        )
    return rows, violations


def parse_policies(spec: str) -> list[str]:
    names = [p.strip() for p in spec.split(",") if p.strip()]
    bad = next(
        (
            p
            for p in names
            if p not in ("defaults", "svip", "none", "confidence", "auto")
            and not (p.startswith("constant-") and p[9:].isdigit())
        ),
        None,
    )
    if bad is not None or "none" not in names:
        raise InvalidRequest(
            f"--serve-policies: defaults, svip, auto, confidence, constant-K and none (required: the "
            f"baseline), got {bad or spec!r}"
        )
    return names


def parse_levels(spec: str) -> list[int]:
    try:
        levels = sorted({int(v) for v in spec.split(",") if v.strip()})
    except ValueError:
        raise InvalidRequest(f"--levels: expected comma-separated integers, got {spec!r}") from None
    if not levels or levels[0] < 1 or levels[-1] > 256:
        raise InvalidRequest("--levels: client counts must be in [1, 256]")
    return levels


def _body(policy: str, threshold: float) -> dict:
    """The request's policy fields: none for the server's defaults."""
    if policy == "defaults":
        return {}
    if policy == "svip":
        return {"policy": "svip", "threshold": threshold}
    if policy.startswith("constant-"):
        return {"policy": "constant", "draft_length": int(policy[9:])}
    return {"policy": policy}


def _stream(client, base: str, ids, max_tokens: int, policy: str, threshold: float) -> dict:
    """One streamed request: its text, token count, time to first token and latency."""
    body = {
        "model": "bench",
        "prompt": list(ids),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        **_body(policy, threshold),
    }
    start = time.perf_counter()
    first, parts, usage = None, [], None
    with client.stream("POST", f"{base}/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["text"]:
                first = first or time.perf_counter()
                parts.append(event["choices"][0]["text"])
            usage = event.get("usage") or usage
    end = time.perf_counter()
    return {
        "text": "".join(parts),
        "tokens": usage["completion_tokens"],
        "ttft": (first or end) - start,
        "latency": end - start,
    }


def _levels(client, base, encoded, texts, args, threshold, policies, levels):
    runs = {(n, p): [] for n in levels for p in policies}  # per repeat: tokens/s, ttfts, latencies
    violations = []
    rng = random.Random(0)
    progress = Progress(args.repeats * len(levels) * len(policies))
    for rep in range(args.repeats):
        for n in levels:
            batch = [i % len(encoded) for i in range(max(n, len(encoded)))]
            for policy in rng.sample(policies, len(policies)):
                start = time.perf_counter()
                with ThreadPoolExecutor(n) as pool:
                    done = list(
                        pool.map(
                            lambda i: _stream(client, base, encoded[i], args.max_new_tokens, policy, threshold), batch
                        )
                    )
                wall = time.perf_counter() - start
                for i, d in zip(batch, done):
                    if d["text"] != texts[i]:
                        violations.append(f"repeat {rep}, concurrency {n}, {policy}, prompt {i}")
                runs[(n, policy)].append(
                    {
                        "tps": sum(d["tokens"] for d in done) / wall,
                        "ttft": [d["ttft"] for d in done],
                        "latency": [d["latency"] for d in done],
                    }
                )
                progress.update(1)
    results = []
    for n in levels:
        for policy in policies:
            reps = runs[(n, policy)]
            tps = [r["tps"] for r in reps]
            ttft = sorted(t for r in reps for t in r["ttft"])
            results.append(
                {
                    "concurrency": n,
                    "policy": policy,
                    "tokens_per_s": statistics.median(tps),
                    "tokens_per_s_min": min(tps),
                    "tokens_per_s_max": max(tps),
                    "over_none": statistics.median([a["tps"] / b["tps"] for a, b in zip(reps, runs[(n, "none")])]),
                    "ttft_p50": statistics.median(ttft),
                    "ttft_p95": nearest_rank(ttft, 0.95),
                    "latency_p50": statistics.median(t for r in reps for t in r["latency"]),
                }
            )
    return results, violations


def _markdown(doc: dict) -> str:
    h = doc["header"]
    lines = [
        f"Command: `{h['command']}`",
        f"Machine: {h['machine']}",
        f"Models: target {h['target']}, draft {h['draft']}; {h['prompts']} prompts, {h['repeats']} repeats, "
        f"{h['max_new_tokens']} new tokens, greedy, streamed over HTTP (SSE) through Ray Serve; svip threshold "
        f"{h['threshold']} (calibrated), defaults = no policy in the request (the server's), none = the "
        f"target alone on the same pipeline; the target's prefill while idle: {h.get('idle_prefill', 'off')}.",
        f"In-process engine, one stream, the defaults: {doc['inprocess_tokens_per_s']:.1f} tokens/s.",
        "",
        "| clients | policy | tokens/s (min–max) | over none | TTFT p50 | TTFT p95 | latency p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        lines.append(
            f"| {r['concurrency']} | {r['policy']} | {r['tokens_per_s']:.1f} ({r['tokens_per_s_min']:.1f}–"
            f"{r['tokens_per_s_max']:.1f}) | {r['over_none']:.2f}x | {1000 * r['ttft_p50']:.0f} ms | "
            f"{1000 * r['ttft_p95']:.0f} ms | {r['latency_p50']:.2f} s |"
        )
    by = {(r["concurrency"], r["policy"]): r for r in doc["results"]}
    levels = h["levels"]
    if len(levels) > 1:
        top = levels[-2] if len(levels) > 2 else levels[-1]
        lines.append(
            f"\n{top} clients over 1 client, aggregate tokens/s: "
            + ", ".join(
                f"{p} {by[(top, p)]['tokens_per_s'] / by[(levels[0], p)]['tokens_per_s']:.2f}x" for p in h["policies"]
            )
            + "."
        )
    lines += [
        "",
        f"In-process batched engine (load-aware), {BATCH} requests:",
        "",
        "| batch size | policy | tokens/s (min–max) | over batch 1 | svip / none | drafted tokens | pauses |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["inprocess_batches"]:
        lines.append(
            f"| {r['batch_size']} | {r['policy']} | {r['tokens_per_s']:.1f} ({r['tokens_per_s_min']:.1f}–"
            f"{r['tokens_per_s_max']:.1f}) | {r['over_batch_1']:.2f}x | {r['svip_over_none']:.2f}x | "
            f"{r['draft_tokens']:.0f} | {r['pauses']:.0f} |"
        )
    lines.append(f"\nExactness: {len(doc['exactness_violations'])} outputs differed from the in-process greedy output.")
    return "\n".join(lines) + "\n"


def _plot(path: Path, results, levels) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for policy in dict.fromkeys(r["policy"] for r in results):
        color = "tab:gray" if policy == "none" else None
        rows = [r for r in results if r["policy"] == policy]
        xs = [r["concurrency"] for r in rows]
        a.plot(xs, [r["tokens_per_s"] for r in rows], "o-", color=color, label=policy)
        b.plot(xs, [1000 * r["ttft_p50"] for r in rows], "o-", color=color, label=f"{policy} p50")
        b.plot(xs, [1000 * r["ttft_p95"] for r in rows], "o--", color=color, alpha=0.6, label=f"{policy} p95")
    for ax, label in ((a, "aggregate tokens/s"), (b, "time to first token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
