"""`svip bench`: the command around the runner and the report. Its arguments need no torch (so
`svip --help` answers at once); run() loads the engine and the runners."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from coordinator.front import load_inprocess
from svip_bench.datasets import CODE, SPECBENCH_CATEGORIES, load_code_prompts, load_specbench, specbench_path
from svip_common.contracts import MAX_CHOICES, SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.pair_config import PairConfig
from svip_common.trees import TREES

DEFAULT_EMULATION = "target=llama-3.1-70b@4xh100,draft=llama-3.1-8b@h100,link=0.1ms"
DEVICE_SCALE = 3  # the default profile's steps, slowed until the embedded pair's forwards here keep within them
QUICK = dict(prompts_per_category=2, repeats=1, max_new_tokens=64, ks="2,4,6")


MAX_HOST_SCALE = 100


def add_host_scale(parser: argparse.ArgumentParser, applies: str = "") -> None:
    """--host-scale, as bench (simulate, device) and plan take it; check_host_scale bounds it."""
    parser.add_argument("--host-scale", type=float, default=1.0,
                        help=f"{applies}the simulated host's work is this machine's times this (1; 0: none, the "
                        f"devices alone; at most {MAX_HOST_SCALE})")


def check_host_scale(value: float) -> None:
    if not 0 <= value <= MAX_HOST_SCALE:  # NaN fails too
        raise InvalidRequest(f"--host-scale must be in [0, {MAX_HOST_SCALE}], got {value}")


def add_arguments(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "--mode",
        choices=["policies", "pipeline", "serve", "replay", "simulate", "device", "choices"],
        default="policies",
        help="policies: length policies and Hugging Face side by side (default); "
        "pipeline: in-process vs distributed sync vs async, concurrency, timeline; "
        "serve: the Serve app over HTTP at --levels streaming clients, --serve-policies side by side, and the "
        "in-process batched engine at batch 1 vs 16; replay: every policy replayed along the target's greedy "
        "continuations in modelled time (no wall clock: noise-free), auto over the best fixed method; simulate: "
        "the distributed pipeline on the devices --emulate names, in virtual time; device: the real pipeline "
        "under device timing on this machine (--emulate) beside the simulation's prediction of the same runs",
    )
    bench.add_argument(
        "--emulate",
        metavar="SPEC",
        dest="emulate_spec",  # not `emulate`: that would time the in-process engine of every mode
        help="simulate, device, pipeline: the devices, target=MODEL@[Nx]DEVICE,draft=MODEL@[Nx]DEVICE,link=LINK"
        "[,scale=S] (pipeline: device timing, only where given) "
        f"(default {DEFAULT_EMULATION}, and for device {DEFAULT_EMULATION},scale={DEVICE_SCALE}: this CPU's "
        "forwards keep within those steps; svip_common/emulation.py)",
    )
    bench.add_argument("--tree", choices=TREES, default="off", dest="sim_tree",
                       help="simulate: also each pipeline with SVIP's blocks as this token tree "
                       "(cape, auto, deep, deep-auto), beside its chains")
    bench.add_argument("--temperature", type=float, default=0.0,
                       help="simulate: sample at this temperature, each prompt seeded by its place (0: greedy, "
                       "the default); choices: the choices' temperature (sampled ones share too, each its "
                       "seed's to the bit)")
    bench.add_argument("--n", type=int, default=4, help="choices: a request's choices, its prompt's pages shared "
                       f"or apart (4; at most {MAX_CHOICES})")
    add_host_scale(bench, "simulate, device: ")
    bench.add_argument("--sim-sessions", default="1,8", help="simulate, device: sessions in flight at once (1,8)")
    bench.add_argument(
        "--dataset", help="spec-bench.jsonl (default ../shared/specbench/spec-bench.jsonl, or $SVIP_SPECBENCH)"
    )
    bench.add_argument(
        "--categories", help=f"comma list from {', '.join(SPECBENCH_CATEGORIES + (CODE,))} (default all)"
    )
    bench.add_argument("--prompts-per-category", type=int, default=10)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--max-prompt-tokens", type=int, default=192, help="keep the last N prompt tokens (192)")
    bench.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="constant draft lengths to run (1..8)")
    bench.add_argument("--thresholds", default="", help="also SVIP at these thresholds, e.g. 0.2,0.4,0.5 (svip-T rows)")
    bench.add_argument(
        "--confidences", default="", help="also the confidence stop at these c, e.g. 0.3,0.5 (confidence-C rows)"
    )
    bench.add_argument(
        "--head",
        help="policies: also draft with a feature head (its directory, or 'eagle': the embedded target's own), "
        "every policy and the oracle as eagle-* rows beside the small draft's; simulate: the head is the draft "
        "(--emulate its device, e.g. draft=eagle3-llama-3.3-70b@h100)",
    )
    bench.add_argument("--no-hf", action="store_true", help="skip Hugging Face's assisted generation")
    bench.add_argument("--quick", action="store_true", help="2 prompts per category, 1 repeat, 64 tokens, k in 2,4,6")
    bench.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: one core, as on a GPU each model owns one device)"
    )
    bench.add_argument(
        "--latencies",
        metavar="MS,MS",
        help="pipeline: also run sync vs async across two nodes (network "
        "namespaces, root) at these round-trip latencies on the link, e.g. 0,1,5",
    )
    bench.add_argument(
        "--svip-threshold",
        type=float,
        help="pipeline, simulate: SVIP's threshold in every mode (default: calibrated for the pair, as --threshold "
             "auto, which times this CPU, so it moves with its load)",
    )
    bench.add_argument(
        "--one-core-each",
        action="store_true",
        help="pipeline: each model on a core of its own as its device: the target alone and the in-process "
        "engine on core 0, the target worker on core 0 and the draft worker on core 1",
    )
    bench.add_argument(
        "--serve-policies",
        default="defaults,svip,none",
        help="serve: the policies compared (defaults, svip, auto, confidence, constant-K, none)",
    )
    bench.add_argument("--levels", default="1,4,16,32", help="serve: concurrent streaming clients (1,4,16,32)")
    bench.add_argument(
        "--long",
        action="store_true",
        help="long generations: every policy at --long-lengths new "
        "tokens, greedy and T=1, on held-out code prompts (--prompts-per-category of them), and the "
        "target's loss by position (svip_bench/long.py)",
    )
    bench.add_argument("--long-lengths", default="512,1024,2000", help="--long: new tokens per run (512,1024,2000)")
    bench.add_argument("--out", default="bench-out", help="directory for results.json, results.md and plots")


def run(args: argparse.Namespace, config: PairConfig) -> int:
    """The bench --mode names, on the pair ``config`` says (its knobs as the flags give them: load_aware
    off unless given, so that each policy runs as configured)."""
    import torch

    from svip_bench.methods import build_head_methods, build_methods
    from svip_bench.report import aggregate, write_all
    from svip_bench.runner import Progress, machine_description, run_all

    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.prompts_per_category < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        raise InvalidRequest("--prompts-per-category, --repeats and --max-new-tokens must be >= 1")
    if not 1 <= args.n <= MAX_CHOICES:
        raise InvalidRequest(f"--n must be in [1, {MAX_CHOICES}], got {args.n}")
    if args.head is not None and (args.long or args.mode not in ("policies", "simulate")):
        raise InvalidRequest("--head applies to --mode policies and simulate (without --long)")
    ks = _parse_ks(args.ks)
    _parse_categories(args.categories)  # a bad list named before any model loads
    _check_emulation(args)
    torch.set_num_threads(args.threads)
    engine = load_inprocess(config)
    if engine.drafter is None:
        raise InvalidRequest("svip bench needs a draft model")
    prompts = prompts_for(CODE if args.long else args.categories, args.dataset, args.prompts_per_category)
    header = {
        "command": "svip bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        "machine": machine_description(),
        "target": engine.target.path,
        "draft": engine.drafter.draft.path,
        "prompts": len(prompts),
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
    }
    if args.long:
        from svip_bench import long

        return long.run(engine, prompts, args, header)
    if args.mode == "pipeline":
        from svip_bench import pipeline

        return pipeline.run(engine, prompts, args, header)
    if args.mode == "choices":
        from svip_bench import choices

        return choices.run(engine, prompts, args, header)
    if args.mode == "serve":
        from svip_bench import serve

        return serve.run(engine, prompts, args, header)
    if args.mode in ("simulate", "device"):
        from svip_bench import device, simulate

        sessions = sorted({1, *_parse_ks(args.sim_sessions, "--sim-sessions", "sessions in flight")})
        if args.head is not None:  # simulate only: the head drafts, on the device --emulate names
            engine = _head_engine(engine, args.head)
            header["draft"] = engine.draft_path
        return (simulate if args.mode == "simulate" else device).run(engine, prompts, args, header, sessions)
    if args.mode == "replay":
        from svip_bench import replay

        return replay.run(engine, prompts, args, header, ks, _parse_floats(args.thresholds, "--thresholds"),
                          _parse_floats(args.confidences, "--confidences"))
    calibration = engine.calibration()
    head_engine = _head_engine(engine, args.head) if args.head is not None else None
    if head_engine is not None:
        header["head"] = head_engine.draft_path
    methods = build_methods(
        ks,
        0.3,
        calibration.threshold,
        include_hf=not args.no_hf,
        thresholds=_parse_floats(args.thresholds, "--thresholds"),
        confidences=_parse_floats(args.confidences, "--confidences"),
    )
    if head_engine is not None:
        head_calibration = head_engine.calibration()
        header["head_auto_calibration"] = head_calibration.to_dict()
        methods += build_head_methods(ks, 0.3, _parse_floats(args.thresholds, "--thresholds"),
                                      head_calibration.threshold)
    print(
        f"bench: {len(prompts)} prompts x {len(methods)} methods x {args.repeats} repeats; "
        f"svip-auto threshold {calibration.threshold} (cost ratio {calibration.cost_ratio:.3f})",
        file=sys.stderr,
    )
    progress = Progress(len(prompts) * len(methods) * args.repeats)
    runs, violations = run_all(
        engine, methods, prompts, args.max_new_tokens, args.repeats, args.max_prompt_tokens, progress=progress,
        head_engine=head_engine,
    )
    header["auto_calibration"] = calibration.to_dict()
    table = aggregate(runs, methods)
    md = write_all(
        Path(args.out), header, table, runs, violations, {"svip": 0.3, "svip-auto": calibration.threshold}, 0.15
    )
    print(md)
    if violations:
        print(f"EXACTNESS VIOLATIONS ({len(violations)}): " + "; ".join(violations[:10]), file=sys.stderr)
        return 1
    return 0


def _check_emulation(args: argparse.Namespace) -> None:
    """--emulate and --host-scale, checked before any model loads; simulate and device take the
    default spec when none is given (device slowed for this CPU), pipeline only times where asked."""
    if args.temperature and args.mode not in ("simulate", "choices"):
        raise InvalidRequest("--temperature applies to --mode simulate and choices")
    SamplingParams(temperature=args.temperature).validate()
    if args.mode in ("simulate", "device") and args.emulate_spec is None:
        args.emulate_spec = DEFAULT_EMULATION + (f",scale={DEVICE_SCALE}" if args.mode == "device" else "")
    if args.emulate_spec is None or args.mode not in ("simulate", "device", "pipeline"):
        return
    from svip_common.emulation import parse_emulation

    if parse_emulation(args.emulate_spec).draft is None:
        raise InvalidRequest(f"--mode {args.mode} compares drafting with the target alone: --emulate needs "
                             "draft=MODEL@DEVICE")
    check_host_scale(args.host_scale)


def prompts_for(categories: str | None, dataset: str | None, per_category: int) -> list:
    """Spec-Bench's prompts of these categories (comma list; None: all) and held-out Python (code)."""
    chosen = _parse_categories(categories)
    spec = [c for c in chosen if c != CODE]
    prompts = []
    if spec:
        prompts += [p for p in load_specbench(specbench_path(dataset), per_category) if p.category in spec]
    if CODE in chosen:
        from svip_assets import SPLIT_FILE

        prompts += load_code_prompts(SPLIT_FILE, per_category)
    return prompts


def _head_engine(engine, head: str):
    """The bench's target with a feature head as its draft ('eagle': the embedded target's own)."""
    from coordinator.engine import SpeculativeEngine
    from draft_worker.feature_draft import load_feature_draft
    from svip_assets import head_path

    path = head_path(head)
    if path is None:
        raise InvalidRequest(f"--head: {head!r} holds no feature head (a config.json naming an EAGLE architecture)")
    return SpeculativeEngine(engine.target, load_feature_draft(path, engine.target), engine.config.replace(draft=path))


def _parse_ks(spec: str, flag: str = "--ks", what: str = "draft lengths") -> list[int]:
    try:
        ks = sorted({int(k) for k in spec.split(",") if k.strip()})
    except ValueError:
        raise InvalidRequest(f"{flag}: expected comma-separated integers, got {spec!r}") from None
    if not ks or ks[0] < 1:
        raise InvalidRequest(f"{flag}: {what} must be >= 1")
    return ks


def _parse_floats(spec: str, flag: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in spec.split(",") if v.strip())
    except ValueError:
        raise InvalidRequest(f"{flag}: expected comma-separated numbers, got {spec!r}") from None
    if any(not 0 <= v <= 10 for v in values):
        raise InvalidRequest(f"{flag}: values must be in [0, 10]")
    return values


def _parse_categories(spec: str | None) -> list[str]:
    known = SPECBENCH_CATEGORIES + (CODE,)
    if spec is None:
        return list(known)
    cats = [c.strip() for c in spec.split(",") if c.strip()]
    unknown = [c for c in cats if c not in known]
    if unknown or not cats:
        raise InvalidRequest(
            f"unknown category {unknown[0] if unknown else '(none)'!r}; choose from {', '.join(known)}"
        )
    return cats
