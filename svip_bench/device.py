"""`svip bench --mode device`: the pipeline as it would run beside GPUs, two ways side by side.

- **Device timing on this machine** (svip_common/device_timing.py): real Ray workers, real gRPC,
  the real protocol and models, every forward lasting the step model of the device `--emulate`
  names (the draft's on a device of its own), the thread waiting out the rest off the CPU.
- **The simulated clock** (coordinator/simulated.py): the same requests through the in-memory
  pair in virtual time, each forward its step model's time, each message the link's.

For the target alone (through the same workers, policy none), distributed sync and async, at each
`--sim-sessions` count (waves of that many requests in flight together; the prompts again, in
turn, where there are fewer), and the in-process engine
with the draft on the target's devices (one session at a time). Every output is checked against
the target alone's. What it says: what the pipeline loses to its own overhead, beside the
simulation's prediction (the issue on cluster timings asks the two agree within 10%)."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from coordinator.cluster import WorkerPair, init_local_ray
from coordinator.distributed import DistributedEngine
from svip_bench.runner import Progress, encode_prompts, full, write_results
from svip_bench.simulate import SplitPairs
from svip_common.contracts import GenerationRequest, PolicyConfig
from svip_common.device_timing import use_summary
from svip_common.emulation import Emulation, parse_emulation

MODES = ("alone", "sync", "async")
NONE = PolicyConfig(name="none")


def run(engine, prompts, args, header: dict, sessions: list[int]) -> int:
    emulation = parse_emulation(args.emulate_spec)
    given = args.svip_threshold
    threshold = given if given is not None else engine.calibration().threshold
    policy = PolicyConfig(name="svip", threshold=threshold)
    encoded = encode_prompts(engine, prompts, args.max_prompt_tokens)
    base = [GenerationRequest(ids, args.max_new_tokens, ignore_eos=True, policy=policy) for ids in encoded]
    expected = [engine.generate(GenerationRequest(r.prompt_ids, r.max_new_tokens, ignore_eos=True, policy=NONE))
                .token_ids for r in base]
    header.update(emulate=emulation.spec, emulated=emulation.describe(), svip_threshold=threshold,
                  sessions=sessions, in_process=emulation.co_located().describe(), host_scale=args.host_scale)
    progress = Progress(args.repeats * (len(sessions) * len(MODES) * 2 + 1))
    rows: dict[tuple, dict] = {}
    violations: list[str] = []

    def record(key, field, tps, outputs):
        rows.setdefault(key, {"sessions": key[0], "mode": key[1]}).setdefault(field, []).append(tps)
        violations.extend(f"{key} {field}: request {i}" for i, (a, b) in enumerate(zip(outputs, full(expected, key[0])))
                          if a != b)
        progress.update(1)

    for _ in range(args.repeats):
        record((1, "in-process"), "device", *_in_process(engine, emulation.co_located(), base))
    device_use = _through_workers(engine, emulation, base, sessions, args.repeats, record)
    pairs = SplitPairs(engine, emulation, args.host_scale)  # kept, as the workers above are
    for _ in range(args.repeats):
        for n in sessions:
            for mode in MODES:
                waves = pairs.waves(full(_as(base, mode), n), n, mode)
                record((n, mode), "simulated", waves.tokens_per_s, waves.outputs)
    table = [{k: (statistics.median(v) if isinstance(v, list) else v) for k, v in row.items()}
             for row in rows.values()]
    doc = {"header": header, "rows": table, "device_use": device_use, "exactness_violations": violations}
    return write_results(Path(args.out), "device", doc, _report(doc))


def _as(requests: list[GenerationRequest], mode: str) -> list[GenerationRequest]:
    return [GenerationRequest(r.prompt_ids, r.max_new_tokens, ignore_eos=True, policy=NONE) for r in requests] \
        if mode == "alone" else requests


def _in_process(engine, emulation: Emulation, requests) -> tuple[float, list]:
    """The in-process engine, draft and target taking turns on one emulated device, one request at a
    time; its device timing is taken off again after."""
    engine.time_as(emulation)
    try:
        engine.generate(GenerationRequest(requests[0].prompt_ids, 8, policy=requests[0].policy))  # warm
        started = time.perf_counter()
        outputs = [engine.generate(r).token_ids for r in requests]
        return sum(map(len, outputs)) / (time.perf_counter() - started), outputs
    finally:
        engine.time_as(None)


def _through_workers(engine, emulation: Emulation, requests, sessions, repeats: int, record) -> dict:
    """Real workers under device timing: each mode at each count, the repeats interleaved; returns
    each worker's device use (its forwards, and those this machine ran past their step)."""
    init_local_ray()
    import ray

    pair = WorkerPair(engine.config.replace(emulate=emulation.spec))  # the in-process engine's knobs
    loop = asyncio.new_event_loop()
    engines = {m: DistributedEngine.for_pair(pair, m) for m in ("sync", "async")}
    try:
        for e in engines.values():
            loop.run_until_complete(e.connect())
        for e in engines.values():  # warm-up
            loop.run_until_complete(e.generate(GenerationRequest(requests[0].prompt_ids, 8,
                                                                 policy=requests[0].policy)))
        for _ in range(repeats):
            for n in sessions:
                for mode in MODES:
                    runner = engines["async" if mode == "alone" else mode]
                    record((n, mode), "device",
                           *loop.run_until_complete(_waves(runner, full(_as(requests, mode), n), n)))
        stats = loop.run_until_complete(engines["async"].worker_stats())
        from svip_proto import convert

        return {role: convert.device_use_from_proto(s.emulated_device) for role, s in stats.items()}
    finally:
        for e in engines.values():
            loop.run_until_complete(e.close())
        loop.close()
        pair.shutdown()
        ray.shutdown()


async def _waves(engine: DistributedEngine, requests, n: int) -> tuple[float, list]:
    """Waves of n requests in flight together (as the simulation runs them): tokens/s and outputs."""
    outputs, started = [], time.perf_counter()
    for first in range(0, len(requests), n):
        results = await asyncio.gather(*(engine.generate(r) for r in requests[first:first + n]))
        outputs += [r.token_ids for r in results]
    return sum(map(len, outputs)) / (time.perf_counter() - started), outputs


def _report(doc: dict) -> str:
    h, rows = doc["header"], doc["rows"]
    alone = {r["sessions"]: r for r in rows if r["mode"] == "alone"}
    in_process = next((r["device"] for r in rows if r["mode"] == "in-process"), None)
    lines = [
        f"Command: `{h['command']}`",
        f"Machine: {h['machine']}",
        f"Devices: {h['emulated']} (distributed: a device each); in process: {h['in_process']} (one device, "
        f"the models taking turns). The tokens of {h['target']} and {h['draft']}; {h['prompts']} prompts, "
        f"{h['max_new_tokens']} new tokens, greedy SVIP at {h['svip_threshold']:.2f}, load-aware off; medians of "
        f"{h['repeats']} repeats. Simulated: host work measured here, times {h['host_scale']}.",
        "",
        "| sessions | mode | device timing, tok/s | simulated, tok/s | simulated / device | vs the target alone "
        "(device) | vs in process (device) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sim, device = r.get("simulated"), r["device"]
        base = alone.get(r["sessions"], {}).get("device")
        cells = [str(r["sessions"]), r["mode"], f"{device:.1f}", _cell(sim, "{:.1f}"),
                 _cell(None if sim is None else sim / device, "{:.2f}"),
                 _cell(None if base is None or r["mode"] == "in-process" else device / base, "{:.2f}x"),
                 _cell(None if in_process is None or r["sessions"] != 1 else device / in_process, "{:.2f}x")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for role, use in doc["device_use"].items():
        lines.append(f"- {role} worker as {use['model']} (scale {use['scale']:g}): {use_summary(use)}")
    return "\n".join(lines)


def _cell(value, form: str) -> str:
    return "" if value is None else form.format(value)
