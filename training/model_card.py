"""Measure the trained pair and write its model card.

    python -m training.model_card --pair build/pair --out svip_assets/pair/MODEL_CARD.md

Reads training.json of each model (parameters, steps, tokens, training time, validation loss)
and measures on the held-out files: greedy acceptance of the draft's argmax against the target's
(teacher-forced along the target's own greedy continuations), acceptance by draft-entropy band,
the draft/target forward cost ratio on this machine, SVIP's best threshold on this machine and at
a GPU-like cost ratio (against the best constant length, modelled from the same trajectories),
the share of held-out function signatures whose greedy completion Python compiles, and samples.
"""

from __future__ import annotations

import argparse
import json
import platform
import sysconfig
from pathlib import Path

import torch

from coordinator.calibration import CostModel, choose_threshold, measure_costs, record_trajectory, replay_svip
from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest
from svip_common.models import load_model
from training.train_pair import encode, evaluate, load_corpus

BANDS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 99.0)
GPU_COST = CostModel(draft_ratio=0.05, verify_slope=0.0)  # a small draft beside a 7B-class target on one GPU each
SAMPLES = ("def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef walk(path):")
CAP = 40


def held_out_signatures(split_file: Path, count: int) -> list[str]:
    """Top-level one-line `def ...:` signatures of the held-out test files."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for rel in json.loads(split_file.read_text())["test"]:
        for line in (lib / rel).read_text(encoding="utf-8").splitlines():
            if line.startswith("def ") and line.rstrip().endswith(":") and line.count("(") == line.count(")"):
                out.append(line.rstrip())
                if len(out) >= count:
                    return out
    return out


def ends_in(signature: str, completion: str, finished: bool) -> bool:
    """Whether the function ended within the completion: a later line back at column 0, or the model's EOS."""
    lines = (signature + completion).split("\n")[1:]
    return finished or any(line.strip() and not line[0].isspace() for line in lines[:-1])


def function_of(signature: str, completion: str) -> str:
    """The signature and its body: the completion's lines up to the first one back at column 0."""
    lines = (signature + completion).split("\n")
    body = [lines[0]]
    for line in lines[1:]:
        if line.strip() and not line[0].isspace():
            break
        body.append(line)
    return "\n".join(body).rstrip() + "\n"


def compiles(source: str) -> bool:
    try:
        compile(source, "<generated>", "exec")
    except (SyntaxError, ValueError):
        return False
    return len(source.strip().splitlines()) > 1  # a body, not the signature alone


def svip_cost(trajs, threshold: float, cap: int, cost: CostModel) -> float:
    """Modelled target forwards per emitted token of SVIP (threshold inf: constant length cap)."""
    totals = [replay_svip(t, threshold, 0.15, cap, cost) for t in trajs]
    return sum(c for c, _ in totals) / sum(e for _, e in totals)


def threshold_rows(trajs, cost: CostModel) -> tuple[float, float, int, float, float]:
    """(best threshold, its cost per token, best constant k, its cost per token, SVIP at 0.3's)."""
    best, table = choose_threshold(trajs, 0.15, CAP, cost)
    constants = {k: svip_cost(trajs, float("inf"), k, cost) for k in range(1, 9)}
    k = min(constants, key=constants.get)
    return best, table[best], k, constants[k], svip_cost(trajs, 0.3, CAP, cost)


def validation_prompts(split_file: Path, count: int, lines: int = 8) -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    names = json.loads(split_file.read_text())["validation"]
    prompts = []
    for rel in names:
        text = (lib / rel).read_text(encoding="utf-8").splitlines()
        for start in range(0, max(1, len(text) - lines), max(1, len(text) // 3)):
            prompts.append("\n".join(text[start : start + lines]) + "\n")
            if len(prompts) >= count:
                return prompts
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="build/pair")
    parser.add_argument("--out", default="svip_assets/pair/MODEL_CARD.md")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--signatures", type=int, default=60, help="held-out function signatures to complete")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = Path(args.pair)
    target, draft = load_model(str(pair / "target")), load_model(str(pair / "draft"))
    info = {k: json.loads((pair / k / "training.json").read_text()) for k in ("target", "draft")}
    val_ids = encode(target.tokenizer, load_corpus()["texts"]["validation"])
    for kind, model in (("target", target), ("draft", draft)):  # the shipped (bfloat16) weights
        info[kind]["validation_loss"] = evaluate(model.model, val_ids, seq_len=256, max_windows=200)
    prompts = validation_prompts(pair / "split.json", args.prompts)
    trajs = [record_trajectory(target, draft, list(target.tokenizer(p)["input_ids"]), args.new_tokens) for p in prompts]
    pairs = [(h, m) for t in trajs for h, m in zip(t.entropies, t.matches)]
    greedy_acceptance = sum(m for _, m in pairs) / len(pairs)
    cost = measure_costs(target, draft)
    ratio = cost.draft_ratio
    here, gpu = threshold_rows(trajs, cost), threshold_rows(trajs, GPU_COST)
    alone = SpeculativeEngine(target, None, load_aware="off")
    signatures = held_out_signatures(pair / "split.json", args.signatures)
    compiled = unfinished = 0
    for sig in signatures:
        ids = tuple(target.tokenizer(sig)["input_ids"])
        result = alone.generate(GenerationRequest(ids, 128))
        text = target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        ok = compiles(function_of(sig, text))
        compiled += ok
        unfinished += not ok and not ends_in(sig, text, result.finish_reason == "stop")
    speculative = SpeculativeEngine(target, draft, load_aware="off")  # each policy as configured
    samples = []
    for prompt in SAMPLES:
        ids = tuple(target.tokenizer(prompt)["input_ids"])
        text = target.tokenizer.decode(speculative.generate(GenerationRequest(ids, 64)).token_ids, skip_special_tokens=True)
        samples.append(f"```python\n{prompt}{text}\n```")
    rows = []
    for lo, hi in zip(BANDS, BANDS[1:]):
        inside = [m for h, m in pairs if lo <= h < hi]
        if inside:
            rows.append(f"| [{lo}, {hi if hi < 99 else '∞'}) | {len(inside)} | {sum(inside) / len(inside):.3f} |")
    draft_info = info["draft"]
    legs = [*draft_info.get("earlier_legs", []), draft_info]
    draft_steps = sum(leg["steps"] for leg in legs)
    draft_tokens = sum(leg["tokens_seen"] for leg in legs)
    draft_time = sum(leg.get("train_s_last_leg", leg.get("train_s", 0.0)) for leg in legs)
    t, dr = info["target"], draft_info
    on_gpu = "device" in t  # trained by training/accelerated.py
    where = f"on one {t['device']} (torch {t['torch']})" if on_gpu else "on CPU (one thread per run)"
    batch = f"{t.get('batch', 16)} x {t.get('seq_len', 256)}"
    if on_gpu:
        how = (
            f"The target was trained from scratch by `training/accelerated.py` {where}, in one time-boxed run, on "
            "the Python standard library's training split plus the Python sources of permissively licensed "
            "packages; the draft was **distilled from the target** by the same script (`--teacher`, `--init` for a "
            "further leg)."
        )
        sources = "\n".join(
            f"| {c['source']} | {c['license']} | {c['files']} | {c['tokens'] / 1e6:.2f}M |" for c in t["corpus"]
        )
        corpus = f"""The training split of the stdlib `.py` files (tests excluded; split by a hash of each file's path:
90% train, 5% validation, 5% test, `split.json`; `svip bench` cuts its `code` category from the test
files, and the validation losses below are on the validation files) plus pydoc's topics, and the
`.py` files of the packages below (their tests and vendored code excluded, files over 400 kB
skipped), tokenized by `python -m training.accelerated prepare` on the development machine so the
GPU machine trained on the same tokens. The weights are derived from these sources, each under the
license its package metadata declares:

| source | license | files | tokens |
|---|---|---|---|
{sources}
"""
    else:
        how = (
            "The target was trained from scratch by `training/train_pair.py` on the Python standard library's own "
            "source (plus pydoc's topic texts); the draft was **distilled from the target** by `training/distill.py`."
        )
        corpus = f"""The stdlib `.py` files of CPython {platform.python_version()} (tests excluded), split by a hash of
each file's path: 90% train, 5% validation, 5% test (`split.json`; `svip bench` cuts its `code`
category from the test files). pydoc's topics join the training split. The corpus is CPython's,
under the Python Software Foundation License Version 2 (PSF-2.0); the weights are derived from it.
"""
    card = (
        f"""# The embedded pair

A draft/target pair of Llama-architecture causal LMs, so that `svip generate` runs on any machine
with no download. {how} Both share one byte-level BPE tokenizer ({len(target.tokenizer)} tokens)
trained on the stdlib training split. Weights are stored in bfloat16 and loaded as float32 by
default.{"" if on_gpu else " Trained " + where + "."}

**What the pair is not.** Not a chat model and not a useful code assistant: a model of Python
source with {t["params"] / 1e6:.1f}M parameters, there so that the system runs, its tests
compare real trained models and the benchmark measures a draft that tracks its target. The
tokenizer's chat template (`chat_template.jinja`) writes a conversation as Python comments
(`# user: ...`) and starts the reply on a fresh line after `# assistant:`, so
`/v1/chat/completions` works; replies are code.

## Corpus, split and license

{corpus}
## Models

| | target | draft |
|---|---|---|
| parameters | {t["params"] / 1e6:.2f}M | {dr["params"] / 1e6:.2f}M |
| layers / hidden / MLP | {t["config"]["num_hidden_layers"]} / {t["config"]["hidden_size"]} / {t["config"]["intermediate_size"]} | {dr["config"]["num_hidden_layers"]} / {dr["config"]["hidden_size"]} / {dr["config"]["intermediate_size"]} |
| how | next-token loss on the corpus | {dr.get("objective", "next-token loss on the corpus")} |
| training steps (batch {batch} tokens) | {t["steps"]} | {draft_steps} ({len(legs)} leg{"s" if len(legs) > 1 else ""}) |
| tokens seen | {t["tokens_seen"] / 1e6:.1f}M | {draft_tokens / 1e6:.1f}M |
| training time ({t.get("device", "1 CPU thread")}) | {t["train_s"] / 60:.0f} min | {draft_time / 60:.0f} min |
| validation loss (nats/token, 200 windows of 256) | {t["validation_loss"]:.3f} | {dr["validation_loss"]:.3f} |

The draft is the target's embedding (tied to its output head), final norm and decoder layers
{", ".join(str(x) for x in dr.get("teacher_layers", []))}, then trained to match the target's next-token
distributions (forward KL) on corpus windows and on the target's own sampled continuations
({dr.get("generations", 0)} in its last leg; half of every batch each): what the target says, where
decoding goes. Its depth is the cost lever ({dr["config"]["num_hidden_layers"]} of the target's {t["config"]["num_hidden_layers"]} layers: a token of the draft costs
{ratio:.2f} of the target's here); its width is the target's, so its representation starts where
the target's does. The validation loss above is against the corpus's tokens; the draft is trained
to agree with the target, not to predict the corpus (the training log records its KL to the
target, step by step).

## As a pair (measured by `python -m training.model_card` on {len(prompts)} validation prompts, {args.new_tokens} greedy tokens each)

- Greedy agreement (draft argmax == target token, teacher-forced along the target's output): **{greedy_acceptance:.3f}** over {len(pairs)} positions.
- Draft/target cost ratio (median one-token forward with a warm cache, 1 CPU thread, this machine): **{ratio:.3f}**; verifying each extra token costs {cost.verify_slope:.3f} of a one-token target forward.
- Held-out function signatures (the first {len(signatures)} top-level one-line `def`s of the test files) whose greedy completion, cut where the function ends, Python's `compile()` accepts within 128 tokens: **{compiled}/{len(signatures)} ({compiled / max(1, len(signatures)):.0%})**; of the {len(signatures) - compiled} that fail, {unfinished} had not ended their function (docstring or body still open) when the 128 tokens ran out.

Acceptance by draft entropy band (nats); SVIP's default threshold 0.3 stops once H > 0.6:

| draft entropy | positions | acceptance |
|---|---|---|
"""
        + "\n".join(rows)
        + f"""

## `--threshold auto` on this pair

Modelled from the same trajectories (target forwards per emitted token; a round costs
1 + (verify slope + cost ratio) x drafted): the threshold `--threshold auto` picks, against the best
constant length and SVIP's default 0.3:

| cost model | auto threshold | its cost / token | best constant k | its cost / token | SVIP 0.3 | auto over best constant |
|---|---|---|---|---|---|---|
| this machine (c = {ratio:.3f}, slope {cost.verify_slope:.3f}) | {here[0]} | {here[1]:.3f} | {here[2]} | {here[3]:.3f} | {here[4]:.3f} | {here[3] / here[1]:.2f}x |
| GPU-like (c = {GPU_COST.draft_ratio}, slope 0) | {gpu[0]} | {gpu[1]:.3f} | {gpu[2]} | {gpu[3]:.3f} | {gpu[4]:.3f} | {gpu[3] / gpu[1]:.2f}x |

## Samples (greedy, SVIP, 64 tokens)

"""
        + "\n\n".join(samples)
        + "\n"
    )
    Path(args.out).write_text(card)
    print(card)


if __name__ == "__main__":
    main()
