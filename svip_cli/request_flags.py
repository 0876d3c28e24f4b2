"""`svip generate`'s own flags: where the prompts come from and what each request asks for (its
policy's knobs past the policy, its sampling, structured output, logprobs), each defaulting to the
request's own default (svip_common/contracts.py: PolicyConfig, SamplingParams), and the request
they make, checked before any model loads."""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path

from svip_common.contracts import INT32_MAX, GenerationRequest, Limits, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.grammar import Grammar

_POLICY, _SAMPLING = PolicyConfig(), SamplingParams()
MAX_NEW_TOKENS = GenerationRequest.max_new_tokens  # a request's own default length (a server's: default_max_tokens)
PROMPT_SOURCES = ("prompt", "prompt_file", "prompt_ids", "input")
GRAMMARS = ("json_object", "json_schema", "regex", "lark")


def add_prompt_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt", nargs="?", help="prompt text")
    src = gen.add_argument_group("prompt sources (exactly one)")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt text from a file")
    src.add_argument("--prompt-ids", metavar="IDS", help="token ids instead of text: 1,2,3")
    src.add_argument("--input", metavar="FILE.jsonl", help='batch: {"prompt": ...} or {"prompt_ids": [...]} per line')


def add_request_arguments(gen: argparse.ArgumentParser) -> None:
    pol = gen.add_argument_group("the request's policy (past --policy, --threshold, --tree)")
    pol.add_argument("--entropy-scale", type=float, default=_POLICY.entropy_scale,
                     help=f"svip: stop once sqrt(scale*H) > threshold ({_POLICY.entropy_scale})")
    pol.add_argument("--draft-length", type=int, default=_POLICY.draft_length,
                     help=f"constant: k; heuristic: starting k ({_POLICY.draft_length})")
    pol.add_argument("--max-draft-length", type=int, default=_POLICY.max_draft_length,
                     help=f"hard cap on any block ({_POLICY.max_draft_length})")
    pol.add_argument("--confidence", type=float, default=_POLICY.confidence,
                     help=f"confidence: stop when q(token) < c ({_POLICY.confidence})")
    smp = gen.add_argument_group("sampling")
    smp.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help=f"({MAX_NEW_TOKENS})")
    smp.add_argument("--temperature", type=float, default=_SAMPLING.temperature, help="0 = greedy (default)")
    smp.add_argument("--top-k", type=int, default=_SAMPLING.top_k, help="0 = off")
    smp.add_argument("--top-p", type=float, default=_SAMPLING.top_p, help=f"({_SAMPLING.top_p})")
    smp.add_argument("--seed", type=int, help="random seed (default: drawn and reported)")
    smp.add_argument("--presence-penalty", type=float, default=_SAMPLING.presence_penalty,
                     help="subtracted from a token's logit once it was generated, in [-2, 2] (0)")
    smp.add_argument("--frequency-penalty", type=float, default=_SAMPLING.frequency_penalty,
                     help="subtracted per time a token was generated, in [-2, 2] (0)")
    smp.add_argument("--min-tokens", type=int, default=_SAMPLING.min_tokens,
                     help="no stop token or EOS before this many tokens (0)")
    smp.add_argument("--repetition-penalty", type=float, default=_SAMPLING.repetition_penalty,
                     help="a token in the prompt or generated before has its logit divided by this where positive, "
                     "multiplied where negative, in (0, 2] (1: off)")
    smp.add_argument("--logit-bias", type=_logit_bias, default=_SAMPLING.logit_bias, metavar="ID=BIAS,...",
                     help="added to the target's and the draft's logits at these token ids, each in [-100, 100] "
                     "(-100 bans a token), at most 300; output exact as the target alone's with the same bias")
    smp.add_argument("--n", type=int, default=1, help="independent samples of one prompt; sample i uses seed + i (1)")
    smp.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="with --json: each output token's log-probability under the target (its logits with the "
                     "request's bias and penalties, before temperature, top-k and top-p) and the top N at its "
                     "place, N in [0, 20]; speculation stays on")
    out = gen.add_argument_group("structured output (at most one)")
    out.add_argument("--json-object", action="store_true",
                     help="the output is a JSON object (OpenAI's response_format json_object)")
    out.add_argument("--json-schema", metavar="SCHEMA",
                     help="the output is JSON this schema accepts: a file, or the schema itself")
    out.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    out.add_argument("--lark", metavar="GRAMMAR", help="the output follows this Lark grammar: a file, or its text")
    run = gen.add_argument_group("output and batching")
    run.add_argument("--json", action="store_true", help="JSON Lines: one object per output")
    run.add_argument("--batch-size", type=int, default=1,
                     help="requests in flight at once (--input, --n): every draft forward advances all that are "
                     "drafting, every target forward verifies all that are ready; outputs in input order, token for "
                     "token as at 1 (1)")


def request_template(args: argparse.Namespace) -> GenerationRequest:
    """Everything but the prompt, validated before any model is loaded."""
    for flag in ("n", "batch_size"):
        if vars(args)[flag] < 1:
            raise InvalidRequest(f"--{flag.replace('_', '-')} must be >= 1, got {vars(args)[flag]}")
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    request = GenerationRequest(
        prompt_ids=(0,),
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p, seed, args.logit_bias,
                                args.presence_penalty, args.frequency_penalty, args.min_tokens,
                                args.repetition_penalty, grammar(args)),
        policy=PolicyConfig(name=args.policy, threshold=args.threshold, entropy_scale=args.entropy_scale,
                            draft_length=args.draft_length, max_draft_length=args.max_draft_length,
                            confidence=args.confidence, tree=args.tree),
        logprobs=args.logprobs,
    )
    request.validate(Limits(tokens=INT32_MAX + 1, positions=None))  # the knobs alone; ids against the model later
    return request


def grammar(args: argparse.Namespace) -> Grammar | None:
    """--json-object, --json-schema, --regex or --lark (at most one), as a grammar (checked with the request)."""
    given = [kind for kind in GRAMMARS if vars(args)[kind]]
    if len(given) > 1:
        raise InvalidRequest("give at most one of --json-object, --json-schema, --regex, --lark")
    if not given:
        return None
    kind = given[0]
    if kind == "json_object":
        return Grammar("json_object")
    text = vars(args)[kind]
    if kind in ("json_schema", "lark") and Path(text).is_file():
        text = Path(text).read_text()
    return Grammar(kind, text)


def prompt_sources(args: argparse.Namespace) -> list[str | list[int]]:
    from svip_cli.prompts import parse_id_list, read_input_file, read_prompt_file, text_prompt

    given = [name for name in PROMPT_SOURCES if vars(args)[name] is not None]
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
