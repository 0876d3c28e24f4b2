"""Train a feature-level draft head (draft_worker/feature_head.py) for the embedded target.

    python -m training.feature_head --out build/head [--train-s 600] [--batch 8] [--seq-len 256]

Each step runs the frozen target over windows of the corpus's training split (the stdlib files of
split.json, tokenized with the pair's tokenizer), takes its hidden states at the head's three fused
layers and its logits there, and trains the head to match the target's next-token distribution
(forward KL) twice over: from the target's fused feature at each position beside the next token's
embedding (the first drafted token), and from the head's own output in its place (the second and
later ones; ``FeatureHead.two_steps``, attending as drafting does). The target's features are
computed as the head trains, not stored: 3 × 256 floats a token would be gigabytes for the corpus.

Time-boxed (--train-s, a cosine schedule sized from the measured step time) and resumable (a rerun
with the same --out continues from OUT/checkpoint.pt). Writes the head in the published layout to
OUT, and OUT/metrics.json: on validation windows, how often the head's first and second drafted
tokens are the target's own choice (greedy agreement, teacher-forced), beside the small draft's on
the same positions, with the training data and time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from draft_worker.feature_head import FeatureHead, HeadConfig, save_head
from svip_assets import default_pair
from svip_common.models import load_model


def kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Forward KL(teacher || student) per position, averaged."""
    t = F.log_softmax(teacher.float(), dim=-1)
    return (t.exp() * (t - F.log_softmax(student.float(), dim=-1))).sum(-1).mean()


def windows(data: np.ndarray, n: int, seq_len: int, rng: np.random.Generator) -> torch.Tensor:
    """n windows of seq_len + 1 tokens: the target reads the first seq_len, the head one more."""
    starts = rng.integers(0, len(data) - seq_len - 2, size=n)
    return torch.from_numpy(np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def target_side(target, head: FeatureHead, ids: torch.Tensor):
    """For windows [B, T+1]: the fused features' inputs at positions 0..T-1 (the three layers),
    the embeddings of tokens 1..T, and the target's logits at 0..T-1."""
    out = target(input_ids=ids[:, :-1], output_hidden_states=True)
    layers = tuple(out.hidden_states[i] for i in head.config.target_layers)
    return layers, target.get_input_embeddings()(ids[:, 1:]), out.logits


def losses(head: FeatureHead, layers, embeds, logits):
    """KL of the first and the second drafted token against the target, at every position of the
    windows where both exist; and the three tensors agreement is read from."""
    features = head.fc(torch.cat(layers, dim=-1))
    h1, h2 = head.two_steps(embeds, features, embeds[:, 1:])
    t = logits.shape[1]
    first, second = head.logits(h1[:, : t - 1]), head.logits(h2[:, : t - 2])
    return kl(first, logits[:, 1:]), kl(second, logits[:, 2:]), (first, second)


def learning_rate(seconds: float, budget: float, peak: float) -> float:
    warm = min(30.0, budget / 20)
    if seconds < warm:
        return peak * max(seconds, 1.0) / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (seconds - warm) / max(budget - warm, 1.0)))))


@torch.no_grad()
def agreement(target, draft, head: FeatureHead, data: np.ndarray, seq_len: int, count: int, seed: int) -> dict:
    """Greedy agreement with the target on validation windows: the head's first and second drafted
    tokens (teacher-forced features) and the small draft's next token, on the same positions."""
    ids = windows(data, count, seq_len, np.random.default_rng(seed))
    layers, embeds, logits = target_side(target, head, ids)
    _, _, (first, second) = losses(head, layers, embeds, logits)
    choice = logits.argmax(-1)
    t = logits.shape[1]
    head_first = head.target_ids(first.argmax(-1)) == choice[:, 1:]
    head_second = head.target_ids(second.argmax(-1)) == choice[:, 2:]
    small = draft(input_ids=ids[:, :-1]).logits.argmax(-1)[:, 1:] == choice[:, 1:]
    return {"positions": int(count * (t - 1)), "head_first_token": round(head_first.float().mean().item(), 4),
            "head_second_token": round(head_second.float().mean().item(), 4),
            "small_draft": round(small.float().mean().item(), 4)}


def corpus(tokenizer, split: str, texts: int | None = None) -> np.ndarray:
    """The split's files, tokenized (the first ``texts`` of them when given)."""
    from training.train_pair import encode, load_corpus

    return encode(tokenizer, load_corpus()["texts"][split][:texts])


def save_checkpoint(path: Path, head, opt, step: int, spent: float, rng: np.random.Generator) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "spent": spent,
                "numpy": rng.bit_generator.state, "torch": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)  # a kill mid-save leaves the previous checkpoint whole


def train(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    target_dir, draft_dir = default_pair()
    target, draft = load_model(target_dir), load_model(draft_dir)
    for model in (target.model, draft.model):
        model.requires_grad_(False)
    head = FeatureHead(HeadConfig.for_target(target.model.config))
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng, step, spent = np.random.default_rng(args.seed), 0, 0.0
    torch.manual_seed(args.seed)
    ckpt = out / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        rng.bit_generator.state = state["numpy"]
        torch.set_rng_state(state["torch"])
        step, spent = state["step"], state["spent"]
        print(f"resumed at step {step}, {spent:.0f} s spent", flush=True)
    train_ids = corpus(target.tokenizer, "train", args.texts)
    last_save = time.time()
    while spent < args.train_s:
        started = time.time()
        for group in opt.param_groups:
            group["lr"] = learning_rate(spent, args.train_s, args.lr)
        layers, embeds, logits = target_side(target.model, head, windows(train_ids, args.batch, args.seq_len, rng))
        first, second, _ = losses(head, layers, embeds, logits)
        loss = first + args.second_weight * second
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step, spent = step + 1, spent + time.time() - started
        if step % 20 == 0:
            print(f"step {step} {spent:.0f}/{args.train_s:.0f} s kl first {first.item():.3f} "
                  f"second {second.item():.3f}", flush=True)
        if time.time() - last_save > args.checkpoint_every_s:
            save_checkpoint(ckpt, head, opt, step, spent, rng)
            last_save = time.time()
    save_checkpoint(ckpt, head, opt, step, spent, rng)
    head.eval()
    save_head(head, out)
    metrics = {
        "validation": agreement(target.model, draft.model, head, corpus(target.tokenizer, "validation", args.texts),
                                args.seq_len, args.eval_windows, args.seed + 1),
        "steps": step, "train_s": round(spent, 1), "tokens_seen": step * args.batch * args.seq_len,
        "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr, "second_weight": args.second_weight,
        "threads": args.threads, "target": target_dir, "parameters": sum(p.numel() for p in head.parameters()),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--train-s", type=float, default=600.0, help="training time budget, seconds")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--second-weight", type=float, default=0.5, help="weight of the second drafted token's loss")
    parser.add_argument("--eval-windows", type=int, default=32)
    parser.add_argument("--texts", type=int, help="only the first N files of each split (a quick run)")
    parser.add_argument("--checkpoint-every-s", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.train_s < 0 or args.batch < 1 or args.seq_len < 4:
        parser.error("--train-s must be at least 0, --batch at least 1 and --seq-len at least 4")
    print(json.dumps(train(args), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
