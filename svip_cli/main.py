"""`svip`: the command line. `svip generate` runs the engine on one prompt, a batch or n samples;
`svip serve` the OpenAI-compatible API; `svip bench` and `svip plan` measure and predict.

Every knob's flag comes from its one declaration (svip_common/knobs.py, svip_cli/knob_flags.py);
the flags that belong to one command alone are declared here and beside it (request_flags.py,
svip_bench/command.py). Errors the user can fix are one line on stderr (`svip: error: ...`) and a
non-zero exit: 2 for bad input, 1 for models that cannot be loaded.
"""

from __future__ import annotations

import argparse
import sys

from coordinator.front import MODES, open_engine
from svip_cli.knob_flags import add_knob_flags, fill_defaults, pair_config
from svip_cli.request_flags import add_prompt_arguments, add_request_arguments, prompt_sources, request_template
from svip_common.errors import InvalidRequest, SvipError
from svip_common.knob import BENCH, GENERATE, PLAN, SERVE, SETTINGS
from svip_common.knobs import carried_by


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise InvalidRequest(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    from svip_bench.command import add_arguments as add_bench_arguments

    parser = _Parser(prog="svip", description="Speculative decoding with SVIP.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    add_prompt_arguments(gen)
    gen.add_argument("--mode", choices=MODES, default="inprocess",
                     help="inprocess (default), or distributed: draft and target as Ray actors over gRPC")
    add_knob_flags(gen, GENERATE)
    add_request_arguments(gen)
    _add_serve_parser(sub)
    bench = sub.add_parser("bench", help="benchmark length policies against each other and Hugging Face")
    add_bench_arguments(bench)
    add_knob_flags(bench, BENCH)
    _add_plan_parser(sub)
    return parser


def _add_serve_parser(sub) -> None:
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API (Ray Serve) on this machine")
    add_knob_flags(srv, SERVE)


def _add_plan_parser(sub) -> None:
    from svip_bench.command import DEFAULT_EMULATION, add_host_scale

    plan = sub.add_parser("plan", help="predict a pair's tokens/s on GPUs, in process and distributed, every "
                          "policy, at each session count, and say which to use")
    plan.add_argument("--emulate", metavar="SPEC", dest="emulate_spec", default=DEFAULT_EMULATION,
                      help="the devices: target=MODEL@[Nx]DEVICE,draft=MODEL@[Nx]DEVICE,link=LINK "
                      f"({DEFAULT_EMULATION})")
    plan.add_argument("--dataset", help="spec-bench.jsonl for sample prompts (default ../shared/specbench/...)")
    plan.add_argument("--categories", default="code", help="sample prompts' categories (code: held-out Python)")
    plan.add_argument("--prompts-per-category", type=int, default=4,
                      help="sample prompts of each category at one session (4); n sessions run the first max(n, "
                      "these) of them, distinct in a wave where there are enough")
    plan.add_argument("--max-new-tokens", type=int, default=48)
    plan.add_argument("--max-prompt-tokens", type=int, default=192)
    plan.add_argument("--sessions", default="1,8,32", help="sessions in flight at once (1,8,32; at most 64)")
    plan.add_argument("--policies", default="svip,auto,constant-3",
                      help="svip (the pair's calibrated threshold), auto, confidence, heuristic, constant-K; "
                           "each optionally +cape, +auto, +deep or +deep-auto: a token tree")
    add_host_scale(plan)
    plan.add_argument("--out", default="plan-out", help="directory for plan.md, plan.json and plan.png")
    add_knob_flags(plan, PLAN)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        given = fill_defaults(args, args.command)
        if args.command == "serve":
            return _serve(args)
        if args.command == "bench":
            from svip_bench.command import run

            return run(args, pair_config(args))
        if args.command == "plan":
            return _plan(args)
        return _generate(args, given)
    except InvalidRequest as exc:
        print(f"svip: error: {exc}", file=sys.stderr)
        return 2
    except SvipError as exc:
        print(f"svip: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _generate(args: argparse.Namespace, given: frozenset[str]) -> int:
    from svip_cli.output import generate_all, report_device_use, results_stream

    prompts = prompt_sources(args)
    base_request = request_template(args)
    distributed_only = sorted(k.cli_flag for k in carried_by(GENERATE) if k.scope == "distributed" and k.name in given)
    if args.mode == "inprocess" and distributed_only:
        raise InvalidRequest(f"{', '.join(distributed_only)} applies to --mode distributed")
    config = pair_config(args)
    if args.mode == "distributed" and config.grpc_tls_dir:
        from svip_runtime.tls import TlsFiles

        TlsFiles.from_dir(config.grpc_tls_dir)  # its files checked before Ray starts
    out = results_stream() if args.mode == "distributed" else sys.stdout
    engine = open_engine(config, args.mode, args.pipeline, args.ray_address)
    try:
        succeeded = generate_all(args, engine, prompts, base_request, out)
        if args.emulate is not None:
            report_device_use(args.emulate, engine.device_use())
    finally:
        engine.close()
    return 0 if succeeded else 1


def _serve(args: argparse.Namespace) -> int:
    from svip_serve.auth import keys_from_env, named_digest
    from svip_serve.local import serve_forever
    from svip_serve.settings import ServeSettings

    settings = {k.name: vars(args)[k.name] for k in carried_by(SERVE) if SETTINGS in k.on}
    settings["api_key_sha256"] = tuple(sorted({named_digest(k) for k in [*args.api_key, *keys_from_env()]}))
    if not settings["api_key_sha256"] and not _loopback(args.host) and not args.allow_open:
        raise InvalidRequest(f"--host {args.host} faces the network and no API key is set: give one (--api-key, "
                             "$SVIP_API_KEY), or pass --allow-open to serve it open")
    return serve_forever(ServeSettings.from_args(settings), args.host, args.port, args.metrics_port)


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _plan(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    import torch

    from coordinator.front import load_inprocess
    from svip_bench import plan
    from svip_bench.command import check_host_scale
    from svip_bench.runner import encode_prompts, machine_description
    from svip_common.emulation import parse_emulation

    emulation = parse_emulation(args.emulate_spec)
    if emulation.draft is None:
        raise InvalidRequest("svip plan compares drafting with the target alone: --emulate needs draft=MODEL@DEVICE")
    policies, sessions = plan.parse_plan_policies(args.policies), plan.parse_sessions(args.sessions)
    if not 1 <= args.prompts_per_category <= 100 or not 1 <= args.max_new_tokens <= 4096:
        raise InvalidRequest("--prompts-per-category must be in 1..100 and --max-new-tokens in 1..4096")
    check_host_scale(args.host_scale)
    config = pair_config(args)
    torch.set_num_threads(1)
    engine = load_inprocess(config)
    if engine.drafter is None:
        raise InvalidRequest("svip plan needs a draft: a model or a feature head (--draft)")
    prompts, few = plan.sample_prompts(args.categories, args.dataset, args.prompts_per_category, max(sessions))
    header = {"command": "svip " + " ".join(shlex.quote(a) for a in sys.argv[1:]), "machine": machine_description(),
              "target": engine.target.path, "draft": engine.draft_path, "prompts": few, "prompts_at_load": len(prompts),
              "max_new_tokens": args.max_new_tokens, "host_scale": args.host_scale}
    encoded = encode_prompts(engine, prompts, args.max_prompt_tokens)
    return plan.run(engine, encoded, emulation, policies, sessions, args.max_new_tokens, header, Path(args.out),
                    args.host_scale, few)


if __name__ == "__main__":
    sys.exit(main())
