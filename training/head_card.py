"""Measure the embedded target's feature head and write its model card.

    python -m training.head_card --head svip_assets/head [--run build/head] [--prompts 16]

Reads the training run's metrics.json (copied beside the head as training.json) and measures, on
the held-out code prompts (`svip bench`'s code category, from the test files): the head's greedy
agreement with the target, teacher-forced (its first and second drafted token) beside the small
draft's, on test windows; acceptance by the head's entropy band in real generation (constant
depth 8, so every band is reached; each drafted token whose prefix the target accepted); and the
cost of a draft step, head and small draft, over one target decode step, timed on this machine.
Also stores the head's `auto` prior beside it (svip_auto_prior.json, as `svip calibrate` does for a
small draft), fit on its own blocks.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from coordinator.calibration import CALIBRATION_PROMPTS, PRIOR_TOKENS, forward_time
from coordinator.engine import SpeculativeEngine
from draft_worker.feature_draft import load_feature_draft
from draft_worker.feature_head import load_head, save_head
from svip_assets import SPLIT_FILE, default_pair
from svip_bench.datasets import load_code_prompts
from svip_common.acceptance import PRIOR_WEIGHTS, AutoEstimate, features, fit_logistic
from svip_common.auto_prior import save_prior
from svip_common.contracts import GenerationRequest, PolicyConfig
from svip_common.models import load_model
from training.feature_head import agreement, corpus

BANDS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 99.0)


def entropy_bands(engine: SpeculativeEngine, prompts: list[tuple[int, ...]], new_tokens: int) -> list[dict]:
    """Acceptance of the head's drafted tokens by its entropy there (constant depth 8, greedy)."""
    pairs: list[tuple[float, bool]] = []

    def on_round(block, verdict, settled):
        pairs.extend((h, i < verdict.accepted) for i, h in enumerate(block.entropies[: verdict.accepted + 1]))

    for ids in prompts:
        engine.generate(GenerationRequest(ids, new_tokens, policy=PolicyConfig(name="constant", draft_length=8),
                                          ignore_eos=True), on_round=on_round)
    rows = []
    for lo, hi in zip(BANDS, BANDS[1:]):
        inside = [ok for h, ok in pairs if lo <= h < hi]
        if inside:
            rows.append({"band": f"[{lo}, {hi if hi < 99 else '∞'})", "tokens": len(inside),
                         "acceptance": sum(inside) / len(inside)})
    return rows


def step_costs(head_engine: SpeculativeEngine, draft_engine: SpeculativeEngine, ids: tuple[int, ...],
               repeats: int = 30) -> dict:
    """Median seconds of one draft step (a block's second token: one pair, or one token) for the head
    and for the small draft, and of one target decode step, all at the same context, batch 1."""
    def draft_step(engine) -> float:
        session = engine.open(GenerationRequest(ids, 64, policy=PolicyConfig(name="constant", draft_length=2)))
        try:
            block = session.propose()  # the head's first round is the target alone: it brings the features
            session.settle(block, session.target.verify(session.committed, block))
            times = []
            for _ in range(repeats):
                draft = session.begin()
                draft.step()  # the first token (the prompt's pairs or tokens taken in)
                started = time.perf_counter()
                draft.step()
                times.append(time.perf_counter() - started)
            return statistics.median(times)
        finally:
            session.close()

    verifier = head_engine.verifier
    seq = verifier.pool.sequence()
    verifier.pool.forward([(seq, list(ids), 1)])
    times = []
    for i in range(repeats):
        started = time.perf_counter()
        verifier.pool.forward([(seq, [ids[i % len(ids)]], 1)])
        times.append(time.perf_counter() - started)
        seq.rollback(len(ids))
    seq.close()
    target_s = statistics.median(times)
    head_s, small_s = draft_step(head_engine), draft_step(draft_engine)
    return {"target_step_ms": target_s * 1e3, "head_step_ms": head_s * 1e3,
            "small_draft_step_ms": small_s * 1e3, "head_cost_ratio": head_s / target_s,
            "small_draft_cost_ratio": small_s / target_s}


def head_prior(engine: SpeculativeEngine, costs: dict, new_tokens: int = PRIOR_TOKENS) -> AutoEstimate:
    """The `auto` policy's prior for the head, as `svip calibrate` stores one for a small draft:
    constant-depth-8 blocks on the calibration prompts, each drafted token whose prefix the target
    accepted labelled by its acceptance, a logistic fit on the head's entropy, q and place (past
    its second token the head degrades), and the cost of a drafted token (a head step and the
    target's verify slope, in target steps)."""
    rows, labels = [], []

    def on_round(block, verdict, settled):
        for i, (h, q) in enumerate(zip(block.entropies[: verdict.accepted + 1], block.probs)):
            rows.append(features(h, q, i + 1))
            labels.append(1.0 if i < verdict.accepted else 0.0)

    for prompt in CALIBRATION_PROMPTS:
        ids = tuple(engine.target.tokenizer(prompt)["input_ids"])
        engine.generate(GenerationRequest(ids, new_tokens, policy=PolicyConfig(name="constant", draft_length=8),
                                          ignore_eos=True), on_round=on_round)
    weights = fit_logistic(torch.tensor(rows, dtype=torch.float64), torch.tensor(labels, dtype=torch.float64),
                           torch.tensor(PRIOR_WEIGHTS, dtype=torch.float64))
    one, many = forward_time(engine.target.model), forward_time(engine.target.model, tokens=9)
    cost = costs["head_cost_ratio"] + max(0.0, (many - one) / 8 / one)
    return AutoEstimate(tuple(float(w) for w in weights), cost)


def write_card(out: Path, training: dict, test: dict, bands: list[dict], costs: dict, machine: str) -> None:
    v = training["validation"]
    band_rows = "\n".join(f"| {b['band']} | {b['tokens']} | {b['acceptance']:.3f} |" for b in bands)
    out.write_text(f"""# The embedded target's feature head

A feature-level draft head in EAGLE-3's layout (`config.json`, `model.safetensors`: `fc`, one
`midlayer`, `norm`, `lm_head`, `d2t`/`t2d`) for the embedded target (`svip_assets/pair/target`),
so that `svip generate --draft eagle` drafts from the target's own hidden states with no download.
It fuses the target's hidden states {training["target_layers"]} (0: the embeddings) through one linear layer,
reads them beside the embedding of the next token (the target's own table: the head has none),
and predicts the token after that over the target's whole vocabulary. Stored in bfloat16, loaded
in the target's dtype. {training["parameters"] / 1e6:.2f}M parameters.

**What it is not.** A head trained for {training["train_s"] / 60:.0f} minutes on a CPU, not the hours
of GPU time a published head gets: its first drafted token agrees with the target
{"less" if v["head_first_token"] < v["small_draft"] else "more"} often than the small draft's
({v["head_first_token"]:.2f} against {v["small_draft"]:.2f} on validation windows). It is here so that
the feature draft runs end to end, its tests compare a trained head against the target, and the
benchmark measures one (docs/benchmarks.md).

## Training

`python -m training.feature_head --out build/head --train-s {training["train_s"]:.0f}` (time-boxed and resumable: a
rerun with the same --out continues, --train-s is the total): the frozen target runs over windows
of the project's corpus (the stdlib training split of `svip_assets/pair/split.json`, the pair's
tokenizer), and the head learns the target's next-token distribution (forward KL) at every
position twice over: from the target's fused feature (its first drafted token) and from its own
output in its place (the second and later ones, attending as drafting does).
{training["steps"]} steps of {training["batch"]} x {training["seq_len"]} tokens
({training["tokens_seen"] / 1e6:.2f}M tokens), {training["train_s"]:.0f} s of training on
{training["threads"]} CPU thread(s) of the development machine, AdamW at {training["lr"]}, cosine schedule.

## Agreement with the target (greedy, teacher-forced)

How often the head's argmax is the target's own next token, at every position of 32 windows of
256 tokens (the head's second token: from its own first output):

| split | positions | head, first token | head, second token | small draft (`svip_assets/pair/draft`) |
|---|---|---|---|---|
{_agreement_row("validation", v)}
{_agreement_row("test", test)}

## Acceptance by the head's entropy

Greedy generation on the held-out code prompts, constant depth 8; each drafted token whose
prefix the target had accepted:

| entropy band (nats) | tokens | acceptance |
|---|---|---|
{band_rows}

## Cost

One draft step (a block's second token) over one target decode step, batch 1, one thread,
medians of 30 ({machine}):

| | ms | over the target |
|---|---|---|
| target decode step | {costs["target_step_ms"]:.2f} | 1 |
| feature head step | {costs["head_step_ms"]:.2f} | {costs["head_cost_ratio"]:.3f} |
| small draft step | {costs["small_draft_step_ms"]:.2f} | {costs["small_draft_cost_ratio"]:.3f} |

Measured by `python -m training.head_card --head svip_assets/head`.
""")


def _agreement_row(split: str, a: dict) -> str:
    return (f"| {split} | {a['positions']} | {a['head_first_token']:.3f} | {a['head_second_token']:.3f} "
            f"| {a['small_draft']:.3f} |")


def store_bf16(run: Path, head_dir: Path) -> None:
    """The run's head in the published layout, its weights in bfloat16 (half the bytes in the package)."""
    head = load_head(run)
    for module in (head.fc, head.midlayer, head.norm, head.lm_head):
        module.to(torch.bfloat16)
    save_head(head, head_dir)
    shutil.copy(run / "metrics.json", head_dir / "training.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", default="svip_assets/head")
    parser.add_argument("--run", help="a training run's directory: its head is stored in --head in bfloat16, its "
                        "metrics.json as training.json")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    head_dir = Path(args.head)
    if args.run:
        store_bf16(Path(args.run), head_dir)
    training = json.loads((head_dir / "training.json").read_text())
    target_dir, draft_dir = default_pair()
    target, draft = load_model(target_dir), load_model(draft_dir)
    head = load_feature_draft(str(head_dir), target)
    training["target_layers"] = tuple(head.head.config.target_layers)
    test = agreement(target.model, draft.model, head.head, corpus(target.tokenizer, "test"), 256, 32, 7)
    prompts = [tuple(target.tokenizer(p.text)["input_ids"]) for p in load_code_prompts(SPLIT_FILE, args.prompts)]
    head_engine = SpeculativeEngine(target, head, load_aware="off")  # each policy as configured
    draft_engine = SpeculativeEngine(target, draft, load_aware="off")
    bands = entropy_bands(head_engine, prompts, args.new_tokens)
    costs = step_costs(head_engine, draft_engine, prompts[0])
    from svip_bench.runner import machine_description

    write_card(head_dir / "MODEL_CARD.md", training, test, bands, costs, machine_description())
    save_prior(head_prior(head_engine, costs), str(head_dir))
    print(json.dumps({"test": test, "bands": bands, "costs": costs}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
