"""`svip`: the command line. `svip generate` runs the engine on one prompt, a batch or n samples.

Errors the user can fix are one line on stderr (`svip: error: ...`) and a non-zero exit:
2 for bad input, 1 for models that cannot be loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import sys
from pathlib import Path

from svip_common.auto_settings import WINDOW, AutoSettings
from svip_common.contracts import (
    DRAFT_LENGTH_CAP,
    DRAFT_PARALLEL,
    INT32_MAX,
    MAX_DRAFT_PARALLEL,
    POLICY_NAMES,
    GenerationRequest,
    Limits,
    PolicyConfig,
    SamplingParams,
)
from svip_common.emulation import parse_emulation
from svip_common.errors import InvalidRequest, SvipError
from svip_common.grammar import Grammar
from svip_common.kv_sizes import DEFAULT_KV_TOKENS
from svip_common.pair_config import PairConfig, check_tp_degree
from svip_common.randomness import choices
from svip_common.step_cost import IDLE_PREFILL_MODES, LOAD_AWARE_MODES
from svip_common.trees import TREES


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise InvalidRequest(f"{message} (see '{self.prog} --help')")


def _threshold(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None


def _logit_bias(text: str) -> tuple[tuple[int, float], ...]:
    """ID=BIAS,ID=BIAS...: biases added to the logits at those token ids (checked with the request)."""
    out = []
    for item in filter(None, text.split(",")):
        token, _, bias = item.partition("=")
        try:
            out.append((int(token), float(bias)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected ID=BIAS pairs separated by commas, got {item!r}") from None
    return tuple(out)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="svip", description="Speculative decoding with SVIP.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt", nargs="?", help="prompt text")
    src = gen.add_argument_group("prompt sources (exactly one)")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt text from a file")
    src.add_argument("--prompt-ids", metavar="IDS", help="token ids instead of text: 1,2,3")
    src.add_argument("--input", metavar="FILE.jsonl", help='batch: {"prompt": ...} or {"prompt_ids": [...]} per line')
    models = gen.add_argument_group("models")
    models.add_argument("--target", help="target model directory or hub id (default: the embedded pair)")
    models.add_argument(
        "--draft",
        help="draft model directory or hub id; a feature head's directory (EAGLE-3 layout), or 'eagle' for the "
        "embedded target's own; 'none' = target alone (default: the embedded pair)",
    )
    models.add_argument(
        "--draft-kind",
        choices=["model", "eagle"],
        help="eagle: --draft is a feature head, a directory or a hub id (fetched into the hub cache); model "
        "(default): a draft model (a directory holding a head is still told by its config.json)",
    )
    models.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16, float64, auto")
    models.add_argument("--device", default="cpu", help="torch device (default cpu)")
    models.add_argument(
        "--mode",
        choices=["inprocess", "distributed"],
        default="inprocess",
        help="inprocess (default), or distributed: draft and target as Ray actors over gRPC",
    )
    models.add_argument(
        "--pipeline", choices=["sync", "async"], help="distributed: async (default) overlaps drafting with verification"
    )
    models.add_argument(
        "--idle-prefill",
        choices=IDLE_PREFILL_MODES,
        help="distributed: while no block is ready, the target takes in what a waiting session needs "
        "first (its last verdict's token, its prompt): for a lone session where it pays (auto, default), "
        "always, or off",
    )
    models.add_argument(
        "--draft-parallel",
        type=int,
        help=f"distributed, async: blocks a session drafts side by side on forked KV pages, its follow-up and the "
        f"continuations prepared for a rejection ({DRAFT_PARALLEL}; 1: one at a time; at most {MAX_DRAFT_PARALLEL})",
    )
    models.add_argument(
        "--target-gpus",
        type=int,
        default=1,
        help="distributed with --device cuda: GPUs the target spans (1); the draft takes one",
    )
    models.add_argument("--target-tp", type=int, default=1,
                        help="the target as this many tensor-parallel ranks, a GPU each (a CPU thread or Ray actor "
                             "without GPUs), each holding 1/N of every layer and of the KV cache (1)")
    models.add_argument(
        "--emulate",
        metavar="SPEC",
        help="device timing on this machine: every forward lasts its model's step on the devices SPEC names, "
        "e.g. target=llama-3.1-70b@4xh100,draft=llama-3.1-8b@h100,link=0.1ms[,scale=2] (in process the two "
        "models take turns on one device; distributed, each worker has its own); a summary goes to stderr",
    )
    models.add_argument(
        "--ray-address", help="distributed: an existing Ray cluster (default: Ray on this machine, loopback only)"
    )
    models.add_argument(
        "--placement",
        choices=["pack", "spread"],
        help="distributed: the draft and the target on one node (pack) or on two (spread)",
    )
    models.add_argument(
        "--grpc-tls-dir",
        metavar="DIR",
        help="distributed: mutual TLS between the workers (DIR holds ca.crt, tls.crt, tls.key)",
    )
    models.add_argument(
        "--insecure-workers",
        action="store_true",
        default=None,
        help="distributed: let the workers talk plaintext gRPC on a node address (refused "
        "without TLS otherwise; packed pairs use loopback and need neither)",
    )
    pol = gen.add_argument_group("length policy")
    pol.add_argument(
        "--policy",
        default="auto",
        help=f"one of {', '.join(POLICY_NAMES)} (default auto: a stop learnt for the pair; svip: the paper's rule)",
    )
    pol.add_argument(
        "--threshold",
        type=_threshold,
        default=0.3,
        help="svip: stop once sqrt(scale*H) > threshold (0.3), or 'auto' (learnt for the pair)",
    )
    pol.add_argument("--entropy-scale", type=float, default=0.15, help="svip: entropy scale (0.15)")
    pol.add_argument("--draft-length", type=int, default=5, help="constant: k; heuristic: starting k (5)")
    pol.add_argument("--max-draft-length", type=int, default=40, help="hard cap on any block (40)")
    pol.add_argument("--confidence", type=float, default=0.4, help="confidence: stop when q(token) < c (0.4)")
    pol.add_argument("--tree", choices=TREES, default="off",
                     help="each block a token tree, the policy deciding its depth (off: a chain, the "
                          "default): cape: CaPE's siblings at each drafted place; auto: those of them that pay "
                          "at the target's measured load; deep: cape and each sibling's own next token; "
                          "deep-auto: those nodes of it that pay")
    _add_auto_arguments(pol)
    smp = gen.add_argument_group("sampling")
    smp.add_argument("--max-new-tokens", type=int, default=128)
    smp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    smp.add_argument("--top-k", type=int, default=0, help="0 = off")
    smp.add_argument("--top-p", type=float, default=1.0)
    smp.add_argument("--seed", type=int, help="random seed (default: drawn and reported)")
    smp.add_argument("--presence-penalty", type=float, default=0.0,
                     help="subtracted from a token's logit once it was generated, in [-2, 2] (0)")
    smp.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="subtracted per time a token was generated, in [-2, 2] (0)")
    smp.add_argument("--min-tokens", type=int, default=0, help="no stop token or EOS before this many tokens (0)")
    smp.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="a token in the prompt or generated before has its logit divided by this where positive, "
                     "multiplied where negative, in (0, 2] (1: off)")
    smp.add_argument("--logit-bias", type=_logit_bias, default=(), metavar="ID=BIAS,...",
                     help="added to the target's and the draft's logits at these token ids, each in [-100, 100] "
                     "(-100 bans a token), at most 300; output exact as the target alone's with the same bias")
    smp.add_argument("--n", type=int, default=1, help="independent samples of one prompt")
    smp.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="with --json: each output token's log-probability under the target (its logits with the "
                     "request's bias and penalties, before temperature, top-k and top-p) and the top N at its "
                     "place, N in [0, 20]; speculation stays on")
    _add_grammar_arguments(gen.add_argument_group("structured output (at most one)"))
    gen.add_argument("--json", action="store_true", help="JSON Lines: one object per output")
    run = gen.add_argument_group("batching")
    run.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="requests in flight at once (--input, --n): one forward serves them all; outputs in input order",
    )
    run.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=DEFAULT_KV_TOKENS,
        help=f"each model's KV pool, in tokens ({DEFAULT_KV_TOKENS}); a request larger than it is refused",
    )
    run.add_argument(
        "--max-batched-tokens",
        type=int,
        help="at most this many tokens in one target forward; a long prompt is prefilled in chunks",
    )
    run.add_argument(
        "--load-aware",
        choices=LOAD_AWARE_MODES,
        default="greedy",
        help="whose blocks hold no more tokens than pay at the target's measured load (none when "
        "verification is compute-bound): greedy requests (default; a seed still reproduces a "
        "sampled output), all (sampled too), or off (each policy as configured)",
    )
    _add_serve_parser(sub)
    from svip_bench.command import add_arguments

    add_arguments(sub.add_parser("bench", help="benchmark length policies against each other and Hugging Face"))
    _add_plan_parser(sub)
    return parser


def _add_grammar_arguments(group) -> None:
    group.add_argument("--json-object", action="store_true",
                       help="the output is a JSON object (OpenAI's response_format json_object)")
    group.add_argument("--json-schema", metavar="SCHEMA",
                       help="the output is JSON this schema accepts: a file, or the schema itself")
    group.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    group.add_argument("--lark", metavar="GRAMMAR", help="the output follows this Lark grammar: a file, or its text")


def _grammar(args: argparse.Namespace) -> Grammar | None:
    """--json-object, --json-schema, --regex or --lark (at most one), as a grammar (checked with the request)."""
    given = [flag for flag in ("json_object", "json_schema", "regex", "lark") if getattr(args, flag)]
    if len(given) > 1:
        raise InvalidRequest("give at most one of --json-object, --json-schema, --regex, --lark")
    if not given:
        return None
    kind = given[0]
    if kind == "json_object":
        return Grammar("json_object")
    text = getattr(args, kind)
    if kind in ("json_schema", "lark") and Path(text).is_file():
        text = Path(text).read_text()
    return Grammar(kind, text)


def _add_auto_arguments(group) -> None:
    group.add_argument(
        "--auto-cost",
        type=float,
        metavar="TAU",
        help="auto: a drafted token's cost in target-alone tokens, fixed (default: measured)",
    )
    group.add_argument(
        "--auto-window",
        type=int,
        default=WINDOW,
        help=f"auto: verdicted tokens the pair's live estimate rests on ({WINDOW})",
    )
    group.add_argument(
        "--no-auto-learn",
        dest="auto_learn",
        action="store_false",
        help="auto: keep the pair's prior (no live fit: reproducible lengths)",
    )


def _auto_settings(args) -> AutoSettings:
    """The auto flags (commands without them, as `svip bench`: the defaults)."""
    return AutoSettings(
        learn=getattr(args, "auto_learn", True),
        cost=getattr(args, "auto_cost", None),
        window=getattr(args, "auto_window", WINDOW),
    ).check()


def _add_plan_parser(sub) -> None:
    from svip_bench.command import DEFAULT_EMULATION

    plan = sub.add_parser("plan", help="predict a pair's tokens/s on GPUs, in process and distributed, every "
                          "policy, at each session count, and say which to use")
    plan.add_argument("--emulate", metavar="SPEC", default=DEFAULT_EMULATION,
                      help="the devices: target=MODEL@[Nx]DEVICE,draft=MODEL@[Nx]DEVICE,link=LINK "
                      f"({DEFAULT_EMULATION})")
    plan.add_argument("--target", help="target model whose tokens are used (default: the embedded pair)")
    plan.add_argument("--draft", help="draft model, or a feature head's directory ('eagle': the embedded target's own; "
                      "emulate it as eagle3-llama-3.1-8b@DEVICE) (default: the embedded pair)")
    plan.add_argument("--dtype", default="float32")
    plan.add_argument("--device", default="cpu")
    plan.add_argument("--dataset", help="spec-bench.jsonl for sample prompts (default ../shared/specbench/...)")
    plan.add_argument("--categories", default="code", help="sample prompts' categories (code: held-out Python)")
    plan.add_argument("--prompts-per-category", type=int, default=4)
    plan.add_argument("--max-new-tokens", type=int, default=48)
    plan.add_argument("--max-prompt-tokens", type=int, default=192)
    plan.add_argument("--sessions", default="1,8,32", help="sessions in flight at once (1,8,32; at most 64)")
    plan.add_argument("--policies", default="svip,auto,constant-3",
                      help="svip (the pair's calibrated threshold), auto, confidence, heuristic, constant-K; "
                           "each optionally +cape, +auto, +deep or +deep-auto: a token tree")
    plan.add_argument("--out", default="plan-out", help="directory for plan.md, plan.json and plan.png")


def _plan(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    import torch

    from svip_bench import plan
    from svip_bench.command import prompts_for
    from svip_bench.runner import encode_prompts, machine_description

    emulation = parse_emulation(args.emulate)
    if emulation.draft is None:
        raise InvalidRequest("svip plan compares drafting with the target alone: --emulate needs draft=MODEL@DEVICE")
    policies, sessions = plan.parse_plan_policies(args.policies), plan.parse_sessions(args.sessions)
    if not 1 <= args.prompts_per_category <= 100 or not 1 <= args.max_new_tokens <= 4096:
        raise InvalidRequest("--prompts-per-category must be in 1..100 and --max-new-tokens in 1..4096")
    torch.set_num_threads(1)
    engine = _load_engine(argparse.Namespace(**{**vars(args), "emulate": None}))
    if engine.drafter is None:
        raise InvalidRequest("svip plan needs a draft: a model or a feature head (--draft)")
    prompts = prompts_for(args.categories, args.dataset, args.prompts_per_category)
    header = {"command": "svip " + " ".join(shlex.quote(a) for a in sys.argv[1:]), "machine": machine_description(),
              "target": engine.target.path, "draft": engine.draft_path, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens}
    encoded = encode_prompts(engine, prompts, args.max_prompt_tokens)
    return plan.run(engine, encoded, emulation, policies, sessions, args.max_new_tokens, header, Path(args.out))


def _add_serve_parser(sub) -> None:
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API (Ray Serve) on this machine")
    srv.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    srv.add_argument("--metrics-port", type=int, default=8080, help="Prometheus metrics on 127.0.0.1 (default 8080)")
    srv.add_argument("--target", help="target model directory or hub id (default: the embedded pair)")
    srv.add_argument("--draft", help="draft model directory or hub id, or a feature head's directory (EAGLE-3 "
                     "layout; 'eagle': the embedded target's own); 'none' = target alone")
    srv.add_argument("--draft-kind", choices=["model", "eagle"],
                     help="eagle: --draft is a feature head, a directory or a hub id (fetched into the hub cache)")
    srv.add_argument(
        "--model-name", help="the model id clients send (default: the target directory's name or hub id, or svip-pair)"
    )
    srv.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16, auto")
    srv.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: each worker takes GPUs")
    srv.add_argument("--target-gpus", type=int, default=1, help="cuda: GPUs the target spans (1)")
    srv.add_argument("--target-tp", type=int, default=1,
                     help="the target as this many tensor-parallel ranks, a Ray actor and a GPU each (1)")
    srv.add_argument("--pipeline", choices=["sync", "async"], default="async")
    srv.add_argument("--emulate", metavar="SPEC", help="device timing on this machine: each worker's forwards last "
                     "its model's step on the devices SPEC names, e.g. target=llama-3.1-70b@4xh100,"
                     "draft=llama-3.1-8b@h100[,scale=2] (svip generate --emulate; measurement without GPUs)")
    srv.add_argument("--replicas", type=int, default=1, help="pipelines (draft + target pairs) to run (1)")
    srv.add_argument("--max-in-flight", type=int, default=16,
                     help="requests generating at once per pipeline; each of a request's n choices is a session (16)")
    srv.add_argument("--max-waiting", type=int, default=32, help="requests waiting per pipeline before 429 (32)")
    srv.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=DEFAULT_KV_TOKENS,
        help=f"each worker's KV pool in tokens ({DEFAULT_KV_TOKENS}); admission counts prompt + max_tokens against it",
    )
    srv.add_argument(
        "--max-batched-tokens",
        type=int,
        default=512,
        help="at most this many tokens in one target forward; longer prompts are prefilled in chunks (512)",
    )
    srv.add_argument(
        "--load-aware",
        choices=LOAD_AWARE_MODES,
        default="greedy",
        help="whose blocks hold no more tokens than pay at the target's load: greedy (default), all, off",
    )
    srv.add_argument(
        "--idle-prefill",
        choices=IDLE_PREFILL_MODES,
        default="auto",
        help="while no block is ready, the target takes in what waiting sessions need first (the last "
        "verdict's token, a new prompt): for a lone session where it pays (auto, default), always, or off",
    )
    srv.add_argument(
        "--draft-parallel",
        type=int,
        default=DRAFT_PARALLEL,
        help=f"async: blocks a session drafts side by side on forked KV pages ({DRAFT_PARALLEL}; 1: one at a time; "
        f"at most {MAX_DRAFT_PARALLEL})",
    )
    srv.add_argument("--policy", default="auto", help=f"default length policy (auto): {', '.join(POLICY_NAMES)}")
    srv.add_argument("--threshold", type=float, default=0.3, help="default svip threshold (0.3)")
    srv.add_argument("--tree", choices=TREES, default="off",
                     help="default token tree (off): cape, auto, deep, deep-auto (a request's `tree` overrides it)")
    srv.add_argument("--tool-call-parser", default="hermes",
                     help="the format chat's tool_choice auto reads the model's calls in: hermes "
                     "(<tool_call>{...}</tool_call>, default), llama3_json (Llama 3.x's JSON) or none (auto refused)")
    _add_auto_arguments(srv)
    srv.add_argument(
        "--draft-length-cap",
        type=int,
        default=DRAFT_LENGTH_CAP,
        help=f"the longest block a request may ask for ({DRAFT_LENGTH_CAP})",
    )
    srv.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024, help="largest request body (4 MiB)")
    srv.add_argument("--max-grammar-compile-ms", type=int, default=250,
                     help="a request's grammar (response_format, tools) that takes longer to compile is a 400; an "
                          "API key may spend 16 times this a minute on the server's parse thread (250)")
    srv.add_argument(
        "--worker-restarts",
        type=int,
        default=5,
        help="times Ray restarts a worker that dies; the sessions in flight go on (5)",
    )
    srv.add_argument(
        "--draft-stall-s",
        type=float,
        default=3.0,
        help="the least a session waits on its draft before it goes on without it (3)",
    )
    srv.add_argument(
        "--sampled-hold-s",
        type=float,
        default=30.0,
        help="how long a sampled session waits for a lost draft, so that its seed reproduces (30)",
    )
    srv.add_argument(
        "--grpc-tls-dir", metavar="DIR", help="mutual TLS between each pipeline's workers (ca.crt, tls.crt, tls.key)"
    )
    srv.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 (repeat for several keys; at least 32 "
        "characters; `name:KEY` names one; prefer $SVIP_API_KEY, comma-separated: ps shows flags)",
    )
    srv.add_argument(
        "--max-wait-s", type=float, default=30.0, help="a request that waited this long for a place gets 429 (30)"
    )
    srv.add_argument(
        "--max-requests-per-key",
        type=int,
        default=0,
        help="requests one API key may have running or waiting per pipeline (0: no limit)",
    )
    srv.add_argument(
        "--default-max-tokens",
        type=int,
        default=2048,
        help="a chat request without max_tokens generates at most this many tokens (2048; the context caps it)",
    )
    srv.add_argument(
        "--drain-timeout-s",
        type=float,
        default=60.0,
        help="on SIGTERM or Ctrl-C: no new requests (503), and those in flight get this long to finish (60)",
    )
    srv.add_argument(
        "--max-tokens-cap",
        type=int,
        default=4096,
        help="a request's max_tokens past this is refused with 400 (4096; the context caps it too)",
    )
    srv.add_argument(
        "--max-kv-tokens-per-key",
        type=int,
        default=0,
        help="KV tokens (prompt + max_tokens) one API key may hold or wait for per pipeline (0: no limit)",
    )
    srv.add_argument(
        "--health-check-period-s",
        type=float,
        default=10.0,
        help="Serve checks each pipeline this often; three failures in a row replace it (10)",
    )
    srv.add_argument("--allow-open", action="store_true",
                     help="serve with no API key on an address other than loopback (refused otherwise)")
    srv.add_argument(
        "--allow-ignore-eos",
        action="store_true",
        help="let requests set ignore_eos (generate to max_tokens past the end of the text)",
    )


def _serve(args: argparse.Namespace) -> int:
    from svip_serve.auth import keys_from_env, named_digest
    from svip_serve.local import serve_forever
    from svip_serve.settings import ServeSettings

    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if not 0 < port < 65536:
            raise InvalidRequest(f"{flag} must be in 1..65535, got {port}")
    # every flag named as the setting it sets goes over as it is (ServeSettings checks them all)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeSettings) if hasattr(args, f.name)}
    given["num_replicas"] = args.replicas
    given["api_key_sha256"] = tuple(sorted({named_digest(k) for k in args.api_key + keys_from_env()}))
    if not given["api_key_sha256"] and not _loopback(args.host) and not args.allow_open:
        raise InvalidRequest(f"--host {args.host} faces the network and no API key is set: give one (--api-key, "
                             "$SVIP_API_KEY), or pass --allow-open to serve it open")
    settings = ServeSettings.from_args(given)
    return serve_forever(settings, args.host, args.port, args.metrics_port)


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command == "serve":
            return _serve(args)
        if args.command == "bench":
            from svip_bench.command import run

            return run(args, _load_engine)
        if args.command == "plan":
            return _plan(args)
        return _generate(args)
    except InvalidRequest as exc:
        print(f"svip: error: {exc}", file=sys.stderr)
        return 2
    except SvipError as exc:
        print(f"svip: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _generate(args: argparse.Namespace) -> int:
    prompts = _prompt_sources(args)
    base_request = _request_template(args)
    for flag in ("pipeline", "idle_prefill", "draft_parallel", "ray_address", "placement", "grpc_tls_dir",
                 "insecure_workers"):
        if args.mode == "inprocess" and getattr(args, flag) is not None:
            raise InvalidRequest(f"--{flag.replace('_', '-')} applies to --mode distributed")
    out = _results_stream() if args.mode == "distributed" else sys.stdout
    engine = _load_engine(args)
    try:
        succeeded = _generate_all(args, engine, prompts, base_request, out)
        if args.emulate is not None:
            _report_device_use(args.emulate, engine.device_use())
    finally:
        if args.mode == "distributed":
            engine.close()
    return 0 if succeeded else 1


def _report_device_use(spec: str, use: dict | None) -> None:
    """One line on stderr per emulated device: its forwards, and those this machine ran past their step."""
    from svip_common.device_timing import use_summary

    for role, u in (use or {}).items():
        print(f"svip: device timing ({spec}): {role} as {u['model']}: {use_summary(u)}", file=sys.stderr)


def _results_stream():
    """Standard output for the results alone: Ray prints its own notices (a worker that died and
    was restarted, say) on the process's stdout, which would break --json's JSON Lines. They go
    to stderr; the results keep the original stdout."""
    sys.stdout.flush()
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return results


def _generate_all(args, engine, prompts, base_request, out) -> bool:
    """Every prompt's --n outputs, in input order: one at a time, or --batch-size at once (one
    forward serves them all; each output is written when all are done). Returns whether every
    request succeeded (one of a batch can fail on its own: the others are still written)."""
    from svip_common.models import encode

    requests = []
    for prompt in prompts:
        ids = encode(engine.target.tokenizer, prompt)
        requests += choices(dataclasses.replace(base_request, prompt_ids=ids), args.n)
    if args.batch_size > 1:
        results = engine.generate_many(requests, args.batch_size)
        return all([_write_result(args, engine, request, result, out) for request, result in zip(requests, results)])
    return all([_write_result(args, engine, request, engine.generate(request), out) for request in requests])


def _write_result(args, engine, request, result, out) -> bool:
    text = engine.target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    if args.json:
        out.write(json.dumps(_result_json(args, engine, request, result, text)) + "\n")
    else:
        out.write(text + "\n")
    out.flush()
    if result.error is not None:  # one of a batch failed on its own; the others were written
        print(f"svip: error: a request failed on its own (the others went on): {result.error}", file=sys.stderr)
    return result.error is None


def _prompt_sources(args: argparse.Namespace) -> list[str | list[int]]:
    from svip_cli.prompts import parse_id_list, read_input_file, read_prompt_file, text_prompt

    given = [name for name in ("prompt", "prompt_file", "prompt_ids", "input") if getattr(args, name) is not None]
    if len(given) != 1:
        raise InvalidRequest(
            "give exactly one prompt source: PROMPT, --prompt-file, --prompt-ids or --input"
            + (f" (got {', '.join(given)})" if given else "")
        )
    if args.prompt is not None:
        return [text_prompt(args.prompt)]
    if args.prompt_file is not None:
        return [read_prompt_file(args.prompt_file)]
    if args.prompt_ids is not None:
        return [parse_id_list(args.prompt_ids)]
    return read_input_file(args.input)


def _request_template(args: argparse.Namespace) -> GenerationRequest:
    """Everything but the prompt, validated before any model is loaded."""
    if args.n < 1:
        raise InvalidRequest(f"--n must be >= 1, got {args.n}")
    for flag in ("batch_size", "kv_cache_tokens", "max_batched_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise InvalidRequest(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    request = GenerationRequest(
        prompt_ids=(0,),
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p, seed, args.logit_bias,
                                args.presence_penalty, args.frequency_penalty, args.min_tokens,
                                args.repetition_penalty, _grammar(args)),
        policy=PolicyConfig(
            name=args.policy,
            threshold=args.threshold,
            entropy_scale=args.entropy_scale,
            draft_length=args.draft_length,
            max_draft_length=args.max_draft_length,
            confidence=args.confidence,
            tree=args.tree,
        ),
        logprobs=args.logprobs,
    )
    request.validate(Limits(tokens=INT32_MAX + 1, positions=None))  # the knobs alone; ids against the model later
    return request


def _load_target(path: str, dtype: str, device: str, tp: int):
    """The in-process target: the whole model, or (tp > 1) rank 0 of a tensor-parallel group whose
    other ranks are threads of this process (svip_common/tensor_parallel.py LocalRanks)."""
    from svip_common.models import DTYPES, load_model

    if tp == 1:
        return load_model(path, dtype, device)
    from transformers import AutoConfig

    from svip_common.tensor_parallel import LocalRanks, check_degree

    check_degree(AutoConfig.from_pretrained(path).get_text_config(decoder=True), tp)  # before any rank starts
    ranks = LocalRanks(path, tp, DTYPES.get(dtype, DTYPES["float32"]), device)
    target = load_model(path, dtype, device, group=ranks.group)
    target.ranks = ranks  # the threads live as long as the model
    return target


def _load_engine(args: argparse.Namespace):
    target_path, draft_path = args.target, args.draft
    spec = getattr(args, "emulate", None)
    emulation = None if spec is None else parse_emulation(spec)  # a bad spec named before any model loads
    if getattr(args, "draft_kind", None) == "eagle" and draft_path in (None, "none"):
        raise InvalidRequest("--draft-kind eagle needs --draft: a feature head's directory or hub id, or 'eagle'")
    if target_path is None:
        from svip_assets import default_pair

        target_path, embedded_draft = default_pair()
        draft_path = embedded_draft if draft_path is None else draft_path
    elif draft_path is None:
        raise InvalidRequest(
            "--draft is required with --target: a draft model directory, or 'none' for the target alone"
        )
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    from coordinator.engine import SpeculativeEngine
    from svip_common.models import load_model

    draft_path = None if draft_path == "none" else draft_path
    head = _head_path(draft_path, args.target, getattr(args, "draft_kind", None))
    if getattr(args, "mode", "inprocess") == "distributed":
        draft_path = head if head is not None else draft_path
        from coordinator.local import LocalDistributed
        from svip_runtime.tls import TlsFiles

        if args.target_gpus < 1:
            raise InvalidRequest(f"--target-gpus must be >= 1, got {args.target_gpus}")
        if args.grpc_tls_dir:
            TlsFiles.from_dir(args.grpc_tls_dir)  # its files checked before Ray starts
        gpus = args.device.startswith("cuda")
        config = PairConfig(
            target=target_path, draft=draft_path, dtype=args.dtype, device=args.device,
            target_gpus=args.target_gpus if gpus else 0, draft_gpus=1 if gpus else 0, layout=args.placement,
            target_tp=args.target_tp,
            grpc_tls_dir=args.grpc_tls_dir, kv_cache_tokens=args.kv_cache_tokens,
            max_batched_tokens=args.max_batched_tokens, load_aware=getattr(args, "load_aware", "off"),
            insecure_workers=bool(getattr(args, "insecure_workers", False)), auto=_auto_settings(args),
            idle_prefill=getattr(args, "idle_prefill", None) or "auto", emulate=getattr(args, "emulate", None),
            draft_parallel=DRAFT_PARALLEL if getattr(args, "draft_parallel", None) is None else args.draft_parallel,
        ).checked()
        return LocalDistributed(config, args.pipeline or "async", args.ray_address)
    tp = check_tp_degree(getattr(args, "target_tp", 1), "--target-tp")
    if emulation is not None and tp > 1 and emulation.target.count != tp:
        raise InvalidRequest(f"--target-tp {tp}, but --emulate times the target on {emulation.target.count} "
                             "device(s): name as many (target=MODEL@NxDEVICE)")
    target = _load_target(target_path, args.dtype, args.device, tp)
    if head is not None and tp > 1:  # a shard holds part of the target's embedding: the head reads its own copy
        from draft_worker.feature_draft import load_head_beside

        draft = load_head_beside(head, target_path, args.dtype, args.device)
    elif head is not None:
        from draft_worker.feature_draft import load_feature_draft

        draft = load_feature_draft(head, target)
    else:
        draft = None if draft_path is None else load_model(draft_path, args.dtype, args.device)
    engine = SpeculativeEngine(
        target,
        draft,
        getattr(args, "kv_cache_tokens", DEFAULT_KV_TOKENS),
        getattr(args, "max_batched_tokens", None),
        getattr(args, "load_aware", "off"),
        _auto_settings(args),
    )
    if emulation is not None:
        engine.time_as(emulation)
    return engine


def _head_path(draft: str | None, target: str | None, kind: str | None) -> str | None:
    """The feature head's directory when the draft is one ('eagle': the embedded target's own; with
    --draft-kind eagle a directory or hub id, fetched into the hub cache)."""
    from svip_assets import head_path

    if draft == "eagle" and target is not None:
        raise InvalidRequest("--draft eagle is the embedded target's head; with --target give the head's directory")
    return head_path(draft, kind)


def _result_json(args, engine, request, result, text: str) -> dict:
    stats = result.stats.to_dict()
    stats["config"] = {
        "mode": args.mode,
        "pipeline": (args.pipeline or "async") if args.mode == "distributed" else None,
        "idle_prefill": (args.idle_prefill or "auto") if args.mode == "distributed" else None,
        "draft_parallel": (args.draft_parallel or DRAFT_PARALLEL) if args.mode == "distributed" else None,
        "target": engine.target.path,
        "draft": engine.draft_path,
        "dtype": args.dtype,
        "device": args.device,
        "max_new_tokens": request.max_new_tokens,
        "policy": _policy_json(engine.resolve(request).policy),
        "sampling": dataclasses.asdict(request.sampling),
        "emulate": args.emulate,
    }
    if request.policy.threshold == "auto" and args.mode == "inprocess" and engine.drafter is not None:
        stats["config"]["threshold_auto"] = engine.calibration().to_dict()
    return {
        "text": text,
        "token_ids": result.token_ids,
        "prompt_token_ids": result.prompt_ids,
        "finish_reason": result.finish_reason,
        **({"error": result.error} if result.error is not None else {}),
        **({"logprobs": [{"token": e.token, "logprob": e.logprob, "top": [list(t) for t in e.top]}
                         for e in result.logprobs]} if result.logprobs is not None else {}),
        "stats": stats,
    }


def _policy_json(policy) -> dict:
    out = dataclasses.asdict(policy)
    out.pop("oracle_tokens")
    return out


if __name__ == "__main__":
    sys.exit(main())
