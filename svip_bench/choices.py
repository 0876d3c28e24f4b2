"""`svip bench --mode choices`: a request's n choices (greedy by default, or sampled with
--temperature; each choice its seed's request) through the in-process batch, the prompt's pages
shared between them on the target and the draft (svip_common/prompt_sharing.py) and apart (no
session forks another's pages; sampled ones still split their prefill, as deployed), alternating,
each prompt's choices together. Prints its command, the machine, wall-time medians, their ratio
and the tokens the target's forwards held; every choice's output must be the same both ways (it
stops with an error otherwise)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from svip_bench.runner import Progress, encode_prompts
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_common.errors import SvipError
from svip_common.randomness import choices

WAYS = ("shared", "apart")


def run(engine, prompts, args, header: dict) -> int:
    n, temperature = args.n, args.temperature
    encoded = encode_prompts(engine, prompts, args.max_prompt_tokens)
    policy = PolicyConfig(name="svip", threshold=engine.calibration().threshold)
    header.update(n=n, temperature=temperature, prompt_tokens=[len(ids) for ids in encoded],
                  svip_threshold=policy.threshold)
    seconds, forwarded, shared_tokens, outputs = {w: [] for w in WAYS}, {}, {}, {}
    workers = {"target": engine.verifier, "draft": engine.drafter}
    progress = Progress(args.repeats * len(WAYS))
    for _ in range(args.repeats):
        for way in WAYS:
            for worker in workers.values():
                worker.sharing.forks = way == "shared"
            before = {k: (w.pool.forward_tokens, w.sharing.shared_tokens) for k, w in workers.items()}
            start, got = time.perf_counter(), []
            for i, ids in enumerate(encoded):
                request = GenerationRequest(ids, args.max_new_tokens, SamplingParams(temperature, seed=i), policy,
                                            ignore_eos=True)
                got += [r.token_ids for r in engine.batch(n).generate_all(choices(request, n))]
            seconds[way].append(time.perf_counter() - start)
            forwarded[way] = {k: w.pool.forward_tokens - before[k][0] for k, w in workers.items()}
            if way == "shared":
                shared_tokens = {k: w.sharing.shared_tokens - before[k][1] for k, w in workers.items()}
            if outputs.setdefault(way, got) != got or outputs.get("shared", got) != got:
                raise SvipError("a choice's output changed with prompt sharing (or between repeats): a bug")
            progress.update(1)
    for worker in workers.values():
        worker.sharing.forks = True
    rows = {w: {"seconds": statistics.median(seconds[w]), "target_forward_tokens": forwarded[w]["target"],
                "draft_forward_tokens": forwarded[w]["draft"]} for w in WAYS}
    header["prompt_tokens_shared"] = shared_tokens
    print(_report(header, rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "choices.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    return 0


def _decoding(temperature: float) -> str:
    return "greedy" if not temperature else f"sampled at temperature {temperature:g}, seeded"


def _report(h: dict, rows: dict) -> str:
    tokens = h["prompts"] * h["n"] * h["max_new_tokens"]
    lines = [
        f"Command: `{h['command']}`",
        f"Machine: {h['machine']}",
        f"{h['target']} and {h['draft']}; {h['prompts']} prompts of {h['prompt_tokens']} tokens, n = {h['n']} "
        f"choices each ({_decoding(h['temperature'])}), {h['max_new_tokens']} new tokens, "
        f"SVIP at {h['svip_threshold']:.2f}; medians of {h['repeats']} repeats; every output the same both ways",
        "",
        "| prompt pages | wall s | tokens/s | target forward tokens | draft forward tokens | vs apart |",
        "|---|---|---|---|---|---|",
    ]
    apart = rows["apart"]["seconds"]
    for way in WAYS:
        row = rows[way]
        lines.append(f"| {way} | {row['seconds']:.2f} | {tokens / row['seconds']:.1f} | {row['target_forward_tokens']} "
                     f"| {row['draft_forward_tokens']} | {apart / row['seconds']:.2f}x |")
    shared = h["prompt_tokens_shared"]
    lines.append(f"\nPrompt tokens taken from another choice's pages: {shared['target']} on the target, "
                 f"{shared['draft']} on the draft.")
    return "\n".join(lines)
