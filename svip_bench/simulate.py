"""`svip bench --mode simulate`: the distributed pipeline on devices this machine does not have (--emulate),
in virtual time (coordinator/simulated.py): the target alone, distributed sync and async, each at one
session and at several in flight, with the real protocol and models on the embedded pair's (or the
given pair's) tokens, each forward timed by its device's step model, each message by the link.
What it cannot know from here: how the pair named by the devices would accept (the tokens are the
given pair's), and a real device's own overheads past the step model (docs/benchmarks.md)."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from coordinator.simulated import SimulatedPair
from draft_worker.drafter import Drafter
from draft_worker.feature_draft import FeatureDrafter
from svip_bench.runner import Progress, encode_prompts
from svip_common.contracts import DRAFT_PARALLEL, GenerationRequest, Limits, PolicyConfig, SamplingParams
from svip_common.emulation import Emulation, parse_emulation
from svip_common.heap import frozen_heap
from target_worker.verifier import Verifier

MODES = ("alone", "inprocess", "sync", "async")


def modes(tree: str) -> tuple[str, ...]:
    """The rows: the target alone, the pair in one process (the draft on the target's devices), each
    pipeline with chains and, with a tree, with that tree."""
    return MODES if tree == "off" else (*MODES, f"sync+{tree}", f"async+{tree}")


def run(engine, prompts, args, header: dict, sessions: list[int]) -> int:
    """sessions: how many in flight at once, each in turn (1 among them: the ratios' base)."""
    emulation = parse_emulation(args.emulate_spec)
    target_step, draft_step, wire = emulation.target, emulation.draft, emulation.link
    fixed = args.svip_threshold
    threshold = fixed if fixed is not None else engine.calibration().threshold  # the calibration times this CPU
    policy = PolicyConfig(name="svip", threshold=threshold)
    tree = args.sim_tree
    parallel = args.draft_parallel
    encoded = encode_prompts(engine, prompts, args.max_prompt_tokens)
    temperature = args.temperature
    header.update(emulate=emulation.spec, emulated=emulation.describe(), target_device=target_step.name,
                  draft_device=draft_step.name, link=wire.name,
                  host_scale=args.host_scale, svip_threshold=threshold, sessions=sessions, draft_parallel=parallel,
                  temperature=temperature,
                  sources={"target": target_step.shape.source, "draft": draft_step.shape.source,
                           "device": target_step.device.source, "link": wire.source})
    rows = []
    progress = Progress(len(modes(tree)) * len(sessions) * args.repeats)
    pairs = SplitPairs(engine, emulation, args.host_scale, parallel)  # kept, as the engine is
    for n in sessions:
        for mode in modes(tree):
            pipeline, _, shape = mode.partition("+")
            asked = PolicyConfig(name="none") if mode == "alone" else replace(policy, tree=shape or "off")
            rates, covered, late, per_forward, prepared = [], [], [], [], []
            for _ in range(args.repeats):
                requests = [GenerationRequest(ids, args.max_new_tokens, SamplingParams(temperature, seed=i),
                                              asked, ignore_eos=True) for i, ids in enumerate(encoded)]
                if mode == "inprocess":
                    waves = in_process_waves(engine, emulation, requests, n, args.host_scale)
                else:
                    waves = pairs.waves(requests, n, pipeline)
                rates.append(waves.tokens_per_s)
                covered.append(waves.covered)
                late.append(waves.covered_late)
                per_forward.append(waves.per_forward)
                prepared.append(waves.prepared_per_token)
                progress.update(1)
            rows.append({"sessions": n, "mode": mode, "tokens_per_s": statistics.median(rates),
                         "prepared_after_rejection": statistics.median(covered),
                         "prepared_late_after_rejection": statistics.median(late),
                         "tokens_per_target_forward": statistics.median(per_forward),
                         "prepared_tokens_per_token": statistics.median(prepared)})
    print(_report(header, rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulate.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    return 0


@dataclass
class Waves:
    """What requests in waves made in virtual time."""

    tokens_per_s: float
    mean_request_s: float  # from its wave's start to its end
    outputs: list[list[int]]
    covered: float = 0.0  # of the rounds after a rejection, the share a prepared continuation started
    per_forward: float = 0.0  # tokens settled per target forward (a batched one's for every session in it)
    covered_late: float = 0.0  # of the rounds after a rejection, the share a prepared continuation started late:
    # sent (or finished drafting) after its verdict
    prepared_per_token: float = 0.0  # tokens drafted for prepared continuations (taken up or not) per token settled


class SplitPairs:
    """The split pairs a benchmark runs through, each kept from wave to wave and from run to run as a
    deployment keeps its workers (their fits of the devices' steps, the host's estimates, the draft
    worker's step cost, the `auto` estimate), as the in-process engine keeps its own: one per
    pipeline (and per `auto` or not), made when first asked for. Once a fresh pair per wave
    measured the split pair cold against a warm engine."""

    def __init__(self, engine, emulation: Emulation, host_scale: float = 1.0, parallel: int = DRAFT_PARALLEL):
        """host_scale: host work measured here, times this; parallel: the speculative blocks an
        async session drafts side by side (draft_worker/service.py)."""
        self.engine, self.emulation, self.host_scale, self.parallel = engine, emulation, host_scale, parallel
        self.pairs: dict[tuple[str, bool], SimulatedPair] = {}

    def pair(self, mode: str, auto: bool) -> SimulatedPair:
        """mode: alone (the target alone), sync or async; auto: whether its requests draft with
        `auto` (the pair then learns into one estimate, from the pair's prior as a deployment makes it)."""
        if (mode, auto) not in self.pairs:
            engine, limits = self.engine, Limits(tokens=self.engine.target.token_limit,
                                                 positions=self.engine.target.max_positions)
            verifier, drafter = _workers(engine, limits, with_draft=mode != "alone")
            self.pairs[(mode, auto)] = SimulatedPair(
                engine.target, verifier, drafter, limits, "sync" if mode == "alone" else mode, self.emulation,
                self.host_scale, load_aware="off", parallel=self.parallel,
                auto=engine.new_auto_estimate() if auto else None)
        return self.pairs[(mode, auto)]

    def waves(self, requests: list[GenerationRequest], n: int, mode: str) -> Waves:
        """The requests in waves of n in flight together through the mode's kept pair in virtual
        time (coordinator/simulated.py; mode alone: the target alone, else sync or async with the
        engine's draft), one after another."""
        pair = self.pair(mode, any(r.policy.name == "auto" for r in requests))
        tokens, seconds, ends, outputs, used, late, rejected = 0, 0.0, [], [], 0, 0, 0
        forwards = pair.host.verifier.pool.forwards
        prepared = 0 if pair.draft is None else pair.draft.prepared_tokens
        for first in range(0, len(requests), n):
            with frozen_heap():  # no full collection of what the run before left lands in this one's host work
                wave = pair.run_all(requests[first:first + n])
            tokens, seconds = tokens + wave.tokens, seconds + wave.makespan_s
            ends += wave.per_request_s
            results = [p.result() for p in wave.pending]
            outputs += [r.token_ids for r in results]
            used += sum(r.stats.prepared_used for r in results)
            late += sum(r.stats.prepared_used_late for r in results)
            rejected += sum(a < d for r in results for d, a in zip(r.stats.draft_lengths, r.stats.accepted_lengths))
        forwards = pair.host.verifier.pool.forwards - forwards
        prepared = 0 if pair.draft is None else pair.draft.prepared_tokens - prepared
        rejected = rejected or 1  # no rejection: none covered
        return Waves(tokens / seconds, statistics.mean(ends), outputs, used / rejected, tokens / forwards,
                     late / rejected, prepared / tokens)


def in_process_waves(engine, emulation: Emulation, requests: list[GenerationRequest], n: int,
                     host_scale: float = 1.0) -> Waves:
    """The requests through the in-process engine in waves of n (batched), the draft on the target's
    devices, their forwards taking turns (Emulation.co_located), in virtual device time; host work
    measured here, times host_scale (0: the device alone)."""
    engine.time_as(emulation.co_located(), virtual=True)
    load_aware, engine.load_aware = engine.load_aware, "off"
    try:
        device, before = engine.verifier.pool.timing.device, engine.verifier.pool.forwards
        with frozen_heap():
            started = time.perf_counter()
            results = [r for first in range(0, len(requests), n)
                       for r in (engine.generate_many(requests[first:first + n], n) if n > 1
                                 else [engine.generate(requests[first])])]
            host_s = time.perf_counter() - started - device.use.real_s
        seconds = device.use.device_s + host_scale * host_s
        forwards = engine.verifier.pool.forwards - before
    finally:
        engine.time_as(None)
        engine.load_aware = load_aware
    tokens = sum(len(r.token_ids) for r in results)
    return Waves(tokens / seconds, seconds / max(1, -(-len(requests) // n)), [r.token_ids for r in results],
                 per_forward=tokens / forwards)


def _workers(engine, limits: Limits, with_draft: bool) -> tuple[Verifier, Drafter | None]:
    """A fresh verifier and drafter for the engine's pair: its draft model, or its feature head
    (the target then hands the head's layers over with each verdict)."""
    target, drafter = engine.target, engine.drafter
    if not with_draft:
        return Verifier(target, limits.tokens), None
    if isinstance(drafter, FeatureDrafter):
        head = drafter.draft
        return (Verifier(target, limits.tokens, feature_layers=head.head.config.target_layers),
                FeatureDrafter(head, drafter.embedding, target.vocab_size, limits.tokens))
    return Verifier(target, limits.tokens), Drafter(drafter.draft, target.vocab_size, limits.tokens)


def _decoding(temperature: float) -> str:
    return "greedy" if not temperature else f"sampled (temperature {temperature:g}, seeded)"


def _report(h: dict, rows: list[dict]) -> str:
    alone = {r["sessions"]: r["tokens_per_s"] for r in rows if r["mode"] == "alone"}
    lines = [
        f"Command: `{h['command']}`",
        f"Machine: {h['machine']} (host work measured here, times {h['host_scale']})",
        f"Simulated: {h['emulated']}; the tokens of "
        f"{h['target']} and {h['draft']}; {h['prompts']} prompts, {h['max_new_tokens']} new tokens, "
        f"{_decoding(h.get('temperature', 0.0))} SVIP at {h['svip_threshold']:.2f}, load-aware off; medians of "
        f"{h['repeats']} repeats (virtual time)",
        "",
        "| sessions | mode | tokens/s | vs the target alone | vs in process | a tree vs its chain | "
        "tokens per target forward | prepared after a rejection (in time + late) | prepared tokens drafted per "
        "token settled |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    inprocess = {r["sessions"]: r["tokens_per_s"] for r in rows if r["mode"] == "inprocess"}
    rate = {(r["sessions"], r["mode"]): r["tokens_per_s"] for r in rows}
    for r in rows:
        chain = r["mode"].partition("+")[0]
        versus = f"{r['tokens_per_s'] / rate[(r['sessions'], chain)]:.2f}x" if "+" in r["mode"] else ""
        in_time, late = r["prepared_after_rejection"], r["prepared_late_after_rejection"]
        asynchronous = r["mode"].startswith("async")
        covered = f"{100 * in_time:.0f}% + {100 * late:.0f}%" if asynchronous else ""
        cost = f"{r['prepared_tokens_per_token']:.2f}" if asynchronous else ""
        lines.append(f"| {r['sessions']} | {r['mode']} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / alone[r['sessions']]:.2f}x | "
                     f"{r['tokens_per_s'] / inprocess[r['sessions']]:.2f}x | {versus} | "
                     f"{r['tokens_per_target_forward']:.2f} | {covered} | {cost} |")
    lines += ["", "Figures from: " + "; ".join(f"{k}: {v}" for k, v in h["sources"].items())]
    return "\n".join(lines)
