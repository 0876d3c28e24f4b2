"""`svip bench --long`: long generations, the paper's long-form comparison on this pair.

Every policy generates --long-lengths new tokens (512, 1,024 and 2,000 by default: up to the
pair's context) from short held-out code prompts, greedy and at temperature 1 (seeded), the
methods interleaved per prompt; tokens/s per policy, length and temperature (median over prompts
and repeats) and each policy's speedup over the target alone. Greedy outputs must equal the
target alone's (the command fails otherwise); sampled ones follow its distribution (tested
elsewhere), so only their speed is compared. And where the target's quality holds: its mean
next-token loss on held-out text by position band, since a model trained on short windows may
degrade before its context ends."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from svip_bench.runner import Progress, write_results
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.knobs import default

LONG_PROMPT_TOKENS = 48  # the prompt's last tokens: most of the context is left to generate
POLICIES = {
    "target": PolicyConfig(name="none"),
    "constant-3": PolicyConfig(name="constant", draft_length=3),
    "heuristic": PolicyConfig(name="heuristic"),
    "confidence": PolicyConfig(name="confidence"),
    "svip": PolicyConfig(name="svip"),
    "auto": PolicyConfig(name="auto"),
    "defaults": PolicyConfig(),  # and the engine's load-aware gate, as `svip generate` runs
}
TEMPERATURES = (0.0, 1.0)
QUALITY_BANDS = (0, 256, 512, 1024, 1536, 2048)


@dataclass
class LongRun:
    method: str
    length: int
    temperature: float
    prompt: int
    repeat: int
    tokens: int
    wall_s: float
    draft_tokens: int
    accepted_tokens: int


def parse_lengths(spec: str, positions: int | None) -> list[int]:
    try:
        lengths = sorted({int(v) for v in spec.split(",") if v.strip()})
    except ValueError:
        raise InvalidRequest(f"--long-lengths: expected comma-separated integers, got {spec!r}") from None
    if not lengths or lengths[0] < 1:
        raise InvalidRequest("--long-lengths: lengths must be >= 1")
    if positions is not None and lengths[-1] + LONG_PROMPT_TOKENS > positions:
        raise InvalidRequest(f"--long-lengths: {lengths[-1]} new tokens and a prompt of up to {LONG_PROMPT_TOKENS} "
                             f"exceed the pair's context of {positions} positions")
    return lengths


def run(engine, prompts, args, header: dict) -> int:
    lengths = parse_lengths(args.long_lengths, engine.limits.positions)
    tok = engine.target.tokenizer
    encoded = [tuple(tok(p.text)["input_ids"][-LONG_PROMPT_TOKENS:]) for p in prompts]
    gated = default("load_aware")  # the defaults row runs as `svip generate` does
    runs, violations = [], []
    total = len(lengths) * len(TEMPERATURES) * len(encoded) * len(POLICIES) * args.repeats
    progress = Progress(total)
    rng = random.Random(0)
    for repeat in range(args.repeats):
        for length in lengths:
            for temperature in TEMPERATURES:
                for i, ids in enumerate(encoded):
                    sampling = SamplingParams(temperature=temperature, seed=1000 + i)
                    reference = None
                    order = list(POLICIES)
                    rng.shuffle(order)
                    order.remove("target")
                    for name in ["target", *order]:  # the target first: the greedy reference
                        engine.load_aware = gated if name == "defaults" else "off"
                        request = GenerationRequest(ids, length, sampling, POLICIES[name], ignore_eos=True)
                        result = engine.generate(request)
                        s = result.stats
                        runs.append(LongRun(name, length, temperature, i, repeat, len(result.token_ids), s.wall_s,
                                            s.draft_tokens, s.accepted_tokens))
                        if temperature == 0.0:
                            reference = result.token_ids if name == "target" else reference
                            if result.token_ids != reference:
                                violations.append(f"{name} at {length} tokens on prompt {i}")
                        progress.update(1)
    engine.load_aware = "off"
    table = summarize(runs)
    quality = target_quality(engine, engine.limits.positions or QUALITY_BANDS[-1])
    doc = {"header": {**header, "mode": "long", "lengths": lengths, "prompt_tokens": LONG_PROMPT_TOKENS},
           "results": table, "target_loss_by_position": quality, "exactness_violations": violations,
           "runs": [vars(r) for r in runs]}
    return write_results(Path(args.out), "long", doc, markdown(doc))


def summarize(runs: list[LongRun]) -> dict:
    """tokens/s (median of each repeat's total over the prompts) and the speedup over the target
    alone, per temperature, length and method."""
    out: dict = {}
    keys = sorted({(r.temperature, r.length) for r in runs})
    for temperature, length in keys:
        cell = [r for r in runs if r.temperature == temperature and r.length == length]
        rates = {}
        for method in POLICIES:
            per_repeat = {}
            for r in (r for r in cell if r.method == method):
                tokens, wall = per_repeat.get(r.repeat, (0, 0.0))
                per_repeat[r.repeat] = (tokens + r.tokens, wall + r.wall_s)
            rates[method] = {rep: t / w for rep, (t, w) in per_repeat.items() if w > 0}
        base = rates["target"]
        row = {}
        for method, by_repeat in rates.items():
            mine = [r for r in cell if r.method == method]
            drafted = sum(r.draft_tokens for r in mine)
            row[method] = {
                "tokens_per_s": statistics.median(by_repeat.values()) if by_repeat else None,
                "speedup": statistics.median(by_repeat[k] / base[k] for k in by_repeat if k in base)
                if by_repeat
                else None,
                "acceptance_rate": sum(r.accepted_tokens for r in mine) / drafted if drafted else None,
            }
        out[f"T={temperature:g}/{length}"] = row
    return out


@torch.inference_mode()
def target_quality(engine, positions: int, files: int = 8) -> list[dict]:
    """The target's mean next-token loss (nats) by position band, on held-out stdlib files long
    enough to fill the context."""
    import sysconfig

    from svip_assets import SPLIT_FILE

    held_out = json.loads(SPLIT_FILE.read_text())["test"]
    lib = Path(sysconfig.get_paths()["stdlib"])
    tok, model = engine.target.tokenizer, engine.target.model
    sums = [0.0] * (len(QUALITY_BANDS) - 1)
    counts = [0] * (len(QUALITY_BANDS) - 1)
    used = 0
    for rel in held_out:
        if used >= files:
            break
        try:
            ids = tok((lib / rel).read_text(encoding="utf-8"))["input_ids"][:positions]
        except (OSError, UnicodeDecodeError):
            continue
        if len(ids) < positions:
            continue
        used += 1
        x = torch.tensor([ids], device=model.device)
        logits = model(input_ids=x).logits[0, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none").tolist()
        for b in range(len(sums)):
            lo, hi = QUALITY_BANDS[b], min(QUALITY_BANDS[b + 1], len(loss))
            sums[b] += sum(loss[lo:hi])
            counts[b] += max(0, hi - lo)
    return [
        {
            "positions": f"{QUALITY_BANDS[b]}-{QUALITY_BANDS[b + 1]}",
            "loss": round(sums[b] / counts[b], 4) if counts[b] else None,
            "files": used,
        }
        for b in range(len(sums))
    ]


def markdown(doc: dict) -> str:
    h = doc["header"]
    lines = [
        f"Command: `{h['command']}`",
        f"Machine: {h['machine']}",
        f"Models: target {h['target']}, draft {h['draft']}; {h['prompts']} prompts of {h['prompt_tokens']} tokens, "
        f"{h['repeats']} repeats; greedy and T=1 (seeded)",
        "",
        "| setting | " + " | ".join(POLICIES) + " |",
        "|---|" + "---|" * len(POLICIES),
    ]
    for key, row in doc["results"].items():
        cells = []
        for method in POLICIES:
            r = row.get(method, {})
            tps, sp = r.get("tokens_per_s"), r.get("speedup")
            cells.append(f"{tps:.1f} ({sp:.2f}x)" if tps is not None and sp is not None else "–")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Target loss by position (nats/token, held-out stdlib files filling the context):",
        "",
        "| positions | loss |",
        "|---|---|",
    ]
    lines += [f"| {q['positions']} | {q['loss']} |" for q in doc["target_loss_by_position"]]
    return "\n".join(lines) + "\n"
