"""Measure the trained pair and write its model card.

    python training/model_card.py --pair build/pair --out svip_assets/pair/MODEL_CARD.md

Reads training.json of each model (parameters, steps, tokens, training time, validation loss)
and measures on the held-out validation files: greedy acceptance of the draft's argmax against the
target's (teacher-forced along the target's own greedy continuations), acceptance by draft-entropy
band, and the draft/target forward cost ratio on this machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import sysconfig
from pathlib import Path

import torch

from coordinator.calibration import measure_cost_ratio, record_trajectory
from svip_common.models import load_model
from training.train_pair import encode, evaluate, load_corpus

BANDS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 99.0)


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
    ratio = measure_cost_ratio(target, draft, repeats=50)
    rows = []
    for lo, hi in zip(BANDS, BANDS[1:]):
        inside = [m for h, m in pairs if lo <= h < hi]
        if inside:
            rows.append(f"| [{lo}, {hi if hi < 99 else '∞'}) | {len(inside)} | {sum(inside) / len(inside):.3f} |")
    card = f"""# The embedded pair

A draft/target pair of Llama-architecture causal LMs trained from scratch by
`training/train_pair.py` on the Python standard library's own source (plus pydoc's topic texts),
so that `svip generate` runs on any machine with no download. Both share one byte-level BPE
tokenizer ({len(target.tokenizer)} tokens) trained on the training split. Weights are stored in
bfloat16 and loaded as float32 by default. The tokenizer's chat template (`chat_template.jinja`)
writes a conversation as Python comments (`# user: ...`) and starts the reply on a fresh line
after `# assistant:`, so `/v1/chat/completions` works on the pair; the models were not trained
on chat, so replies are code.

## Corpus and split

The stdlib `.py` files of CPython {platform.python_version()} (tests excluded), split by a hash of each
file's path: 90% train, 5% validation, 5% test (`split.json`; `svip bench` cuts its `code`
category from the test files). pydoc's topics join the training split.

## Models

| | target | draft |
|---|---|---|
| parameters | {info['target']['params'] / 1e6:.2f}M | {info['draft']['params'] / 1e6:.2f}M |
| layers / hidden | {info['target']['config']['num_hidden_layers']} / {info['target']['config']['hidden_size']} | {info['draft']['config']['num_hidden_layers']} / {info['draft']['config']['hidden_size']} |
| training steps (batch 16 x 256 tokens) | {info['target']['steps']} | {info['draft']['steps']} |
| tokens seen | {info['target']['tokens_seen'] / 1e6:.1f}M | {info['draft']['tokens_seen'] / 1e6:.1f}M |
| training time (1 CPU thread) | {info['target']['train_s'] / 60:.0f} min | {info['draft']['train_s'] / 60:.0f} min |
| validation loss (nats/token, 200 windows of 256) | {info['target']['validation_loss']:.3f} | {info['draft']['validation_loss']:.3f} |

## As a pair (measured by `training/model_card.py` on {len(prompts)} validation prompts, {args.new_tokens} greedy tokens each)

- Greedy acceptance (draft argmax == target token, teacher-forced along the target's output): **{greedy_acceptance:.3f}** over {len(pairs)} positions.
- Draft/target cost ratio (median one-token forward with a warm cache, 1 CPU thread, this machine): **{ratio:.3f}**.

Acceptance by draft entropy band (nats); SVIP's default threshold 0.3 stops once H > 0.6:

| draft entropy | positions | acceptance |
|---|---|---|
""" + "\n".join(rows) + "\n"
    Path(args.out).write_text(card)
    print(card)


if __name__ == "__main__":
    main()
