"""Fault drill: streams in flight through a worker's loss, against the Serve app on this machine.

    python -m svip_bench.fault_drill --clients 16 --max-tokens 200 --out bench-out/faults

Starts `svip serve` (the embedded pair unless --target/--draft), runs CLIENTS greedy streams once
undisturbed (the reference texts), then once through each fault: the draft worker SIGKILLed, the
draft worker SIGSTOPped for --stop-s seconds, the target worker SIGKILLed, each once the streams
are under way. Reports per fault: streams complete and exact, errors, wall time against the
undisturbed run, the longest gap with no token to any client (what the fault cost), and whether
new requests were refused. The tests (tests/integration/test_serve_recovery.py) run the same drill
with fewer tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS = [
    "def fibonacci(n):", "import os\n\ndef walk(path):", "class Stack:\n    def __init__(self):",
    "def parse_args(argv):", "# Sort a list of numbers\ndef sort(xs):", "def read_lines(path):",
    "class Point:", "def gcd(a, b):", "import json\n\ndef load(path):", "def is_prime(n):",
    "def flatten(items):", "class Node:\n    def __init__(self, value):", "def merge(a, b):",
    "def count_words(text):", "def main():\n    parser =", "def reverse(s):",
]
FAULTS = ("draft-kill", "draft-stop", "target-kill")
ACTORS = {"draft": "ray::DraftActor", "target": "ray::TargetActor"}


@dataclass
class Stream:
    text: str = ""
    error: dict | None = None
    chunks: list[float] = field(default_factory=list)  # arrival time of each text chunk
    svip: dict | None = None
    done: bool = False


def stream_completion(base: str, prompt: str, max_tokens: int, on_chunk=None, out: Stream | None = None) -> Stream:
    """One greedy streaming completion, as a client sees it (filled into ``out`` as it arrives);
    on_chunk() after each text chunk."""
    import httpx

    out = Stream() if out is None else out
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                r.read()
                out.error = {"status": r.status_code, "body": r.text[:300]}
                return out
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = event["error"]
                    continue
                choice = event["choices"][0]
                if choice.get("text"):
                    out.text += choice["text"]
                    out.chunks.append(time.monotonic())
                    if on_chunk is not None:
                        on_chunk()
                if event.get("svip"):
                    out.svip = event["svip"]
    except Exception as exc:  # a broken connection is an error the drill reports
        out.error = {"exception": f"{type(exc).__name__}: {exc}"}
    out.done = out.error is None
    return out


def worker_pid(root_pid: int, role: str, timeout_s: float = 120.0) -> int:
    """The pid of the pair's draft or target worker, below root_pid (a restarted one once it runs)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [pid for pid, args in _descendants(root_pid).items() if args.startswith(ACTORS[role])]
        if len(found) == 1:
            return found[0]
        time.sleep(0.2)
    raise RuntimeError(f"no single {role} worker process below pid {root_pid}")


def _descendants(pid: int) -> dict[int, str]:
    rows = [line.split(None, 2) for line in subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True,
                                                            text=True, check=True).stdout.splitlines()]
    children: dict[int, list] = {}
    for row in rows:
        if len(row) == 3:
            children.setdefault(int(row[1]), []).append((int(row[0]), row[2]))
    out, todo = {}, [pid]
    while todo:
        for child, args in children.get(todo.pop(), []):
            out[child] = args
            todo.append(child)
    return out


def inject(fault: str, root_pid: int, stop_s: float | None) -> threading.Timer | None:
    """Apply a fault now; a stop is lifted by the returned timer after stop_s (None: by
    ``resume(timer)`` once the caller says so)."""
    role = fault.split("-")[0]
    pid = worker_pid(root_pid, role)
    if fault.endswith("kill"):
        os.kill(pid, signal.SIGKILL)
        return None
    os.kill(pid, signal.SIGSTOP)
    timer = threading.Timer(stop_s if stop_s is not None else 1e9, os.kill, (pid, signal.SIGCONT))
    timer.start()
    return timer


def resume(timer: threading.Timer | None) -> None:
    """Lift a stop now (the timer's action, run at once) and wait for it."""
    if timer is not None and timer.is_alive():
        timer.cancel()
        timer.function(*timer.args)


def run_streams(base: str, prompts: list[str], max_tokens: int, fault: str | None = None, root_pid: int = 0,
                stop_s: float | None = 20.0, after_chunks: int = 4, gate=None, gate_steps: int = 3) -> dict:
    """Every prompt as a stream at once; the fault once the streams are under way, far from done:
    with ``gate`` (tests/gates.py's TargetGate: the target's steps held by construction), once
    the target has verified gate_steps batches, holds the next and every client has text (one
    more step granted at a time until each has), released after the fault;
    without, once the streams have after_chunks chunks each on average. stop_s None: a stopped
    draft resumes only after every stream has ended (so they ended without it)."""
    results: list[Stream | None] = [None] * len(prompts)
    started = time.monotonic()
    timer, fault_at = None, None
    count, lock, under_way = [0], threading.Lock(), threading.Event()

    streams = [Stream() for _ in prompts]  # what each client has received so far

    def on_chunk():
        with lock:
            count[0] += 1
            if count[0] >= after_chunks * len(prompts):
                under_way.set()

    held = gate.held(gate_steps) if gate is not None and fault is not None else contextlib.nullcontext()
    with ThreadPoolExecutor(len(prompts)) as pool, held:
        futures = [pool.submit(stream_completion, base, p, max_tokens, on_chunk, out)
                   for p, out in zip(prompts, streams)]
        if fault is not None:
            while not _under_way(gate, under_way, streams):
                if all(f.done() for f in futures):
                    raise RuntimeError("the streams ended before the fault; raise --max-tokens")
                time.sleep(0.05)
            fault_at = time.monotonic()
            timer = inject(fault, root_pid, stop_s)
            if gate is not None:
                gate.release()
        for i, f in enumerate(futures):
            results[i] = f.result()
    wall = time.monotonic() - started
    if stop_s is None:
        resume(timer)
    chunks = sorted(t for r in results for t in r.chunks)
    after = [t for t in chunks if fault_at is None or t >= fault_at]
    gap = max((b - a for a, b in zip(after, after[1:])), default=0.0)
    if fault_at is not None and after:
        gap = max(gap, after[0] - fault_at)
    return {
        "fault": fault,
        "wall_s": wall,
        "results": results,
        "longest_gap_s": gap,
        "timer": timer,
        "fault_at_s": fault_at - started if fault_at is not None else None,
    }


def _under_way(gate, chunks_seen: threading.Event, streams: list[Stream]) -> bool:
    """Whether the fault may land: without a gate, once the clients have their chunks; with one,
    once the target holds and every client has text (else one more step, and look again)."""
    if gate is None:
        return chunks_seen.is_set()
    if not gate.holding():
        return False
    if all(s.text for s in streams):
        return True
    gate.grant(1)
    return False


def summarize(run: dict, reference: list[str]) -> dict:
    results = run["results"]
    exact = sum(1 for r, ref in zip(results, reference) if r.done and r.text == ref)
    stats = [r.svip or {} for r in results]
    return {
        "fault": run["fault"],
        "streams": len(results),
        "complete_exact": exact,
        "errors": sum(1 for r in results if r.error is not None),
        "wall_s": round(run["wall_s"], 2),
        "longest_gap_s": round(run["longest_gap_s"], 2),
        "detached": sum(s.get("detached", 0) for s in stats),
        "reattached": sum(s.get("reattached", 0) for s in stats),
        "target_restarts": sum(s.get("target_restarts", 0) for s in stats),
        "first_error": next((r.error for r in results if r.error is not None), None),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--stop-s", type=float, default=20.0, help="how long the draft-stop fault holds the draft")
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--out", default="bench-out/faults")
    parser.add_argument("--target")
    parser.add_argument("--draft")
    args = parser.parse_args()
    from svip_serve import local
    from svip_serve.settings import ServeSettings

    settings = ServeSettings(
        target=args.target,
        draft=args.draft,
        model_name="drill",
        max_in_flight=args.clients,
        max_waiting=args.clients,
        allow_ignore_eos=True,
    )
    command = "python -m svip_bench.fault_drill " + " ".join(sys.argv[1:])
    print(
        f"command: {command}\nmachine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}", flush=True
    )
    base = local.start(settings, port=_free_port()).removesuffix("/v1")
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.clients)]
    rows = []
    try:
        stream_completion(base, prompts[0], 8)  # warm-up
        undisturbed = run_streams(base, prompts, args.max_tokens)
        reference = [r.text for r in undisturbed["results"]]
        rows.append(summarize(undisturbed, reference))
        for fault in args.faults.split(","):
            run = run_streams(base, prompts, args.max_tokens, fault, os.getpid(), args.stop_s)
            rows.append(summarize(run, reference))
            if run["timer"] is not None:
                run["timer"].join()  # the stopped draft goes on before the next fault
            time.sleep(2.0)
    finally:
        local.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    lines = [
        "| fault | streams exact | errors | wall s | vs undisturbed | longest token gap s | detached | re-attached "
        "| target restarts |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base_wall = rows[0]["wall_s"]
    for r in rows:
        lines.append(
            f"| {r['fault'] or 'none'} | {r['complete_exact']}/{r['streams']} | {r['errors']} | {r['wall_s']} | "
            f"{r['wall_s'] / base_wall:.2f}x | {r['longest_gap_s']} | {r['detached']} | {r['reattached']} | "
            f"{r['target_restarts']} |"
        )
    md = "\n".join(lines)
    (out / "faults.md").write_text(md + "\n")
    print(md)
    return 0 if all(r["complete_exact"] == r["streams"] for r in rows) else 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
