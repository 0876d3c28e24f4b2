"""Distill the embedded draft from the embedded target (DistillSpec-style).

    python -m training.distill --teacher build/pair/target --out build/pair/draft --steps N

The draft learns the target's own next-token distributions, not the corpus's hard labels: the loss
is the forward KL from the target's (softened) distribution to the draft's, on windows of corpus
text and on the target's own sampled continuations (half of every batch each), which is where the
draft has to agree with the target during decoding. The draft starts from the target's embedding,
final norm and first layer (same width, fewer layers), so it begins close to the target's
representation and is cheap per token.

Checkpoints every --checkpoint-every steps into --out/checkpoint.pt (model, optimizer, step and
random states); a rerun with the same arguments resumes from it, so an interrupted run loses at
most one interval and ends with the same weights as an uninterrupted one.
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
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from training.train_pair import encode, evaluate, load_corpus, run_log


def draft_from_teacher(teacher: LlamaForCausalLM, layers: tuple[int, ...]) -> LlamaForCausalLM:
    """A shallower copy of the teacher: its embedding, final norm and the chosen decoder layers."""
    config = LlamaConfig(**{**teacher.config.to_dict(), "num_hidden_layers": len(layers)})
    draft = LlamaForCausalLM(config)
    draft.model.embed_tokens.load_state_dict(teacher.model.embed_tokens.state_dict())
    draft.model.norm.load_state_dict(teacher.model.norm.state_dict())
    for mine, theirs in enumerate(layers):
        draft.model.layers[mine].load_state_dict(teacher.model.layers[theirs].state_dict())
    draft.tie_weights()
    return draft


def shape_of(model: LlamaForCausalLM) -> dict:
    """The config fields that say a model's size, as training.json records them."""
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    return {k: getattr(model.config, k) for k in keys}


@torch.no_grad()
def target_generations(teacher, data: np.ndarray, count: int, prompt_len: int, total_len: int, seed: int,
                       device="cpu", batch: int = 32) -> np.ndarray:
    """The target's own sampled continuations (temperature 1) of random corpus windows: [count, total_len + 1]."""
    rng = np.random.default_rng(seed + 1)
    torch.manual_seed(seed + 1)
    teacher.eval()
    rows = []
    for start in range(0, count, batch):
        n = min(batch, count - start)
        offsets = rng.integers(0, len(data) - prompt_len - 1, size=n)
        prompts = torch.from_numpy(np.stack([data[o : o + prompt_len] for o in offsets]).astype(np.int64)).to(device)
        out = teacher.generate(
            prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=total_len + 1 - prompt_len, min_new_tokens=total_len + 1 - prompt_len,
        )
        rows.append(out[:, : total_len + 1].cpu().numpy())
    return np.concatenate(rows).astype(np.int64)


def corpus_windows(data: np.ndarray, n: int, seq_len: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(data) - seq_len - 1, size=n)
    return torch.from_numpy(np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int64))


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Forward KL(teacher_T || student_T) per token, scaled by T^2 (Hinton) so the gradient's size stays put."""
    t = temperature
    teacher_logp = F.log_softmax(teacher_logits / t, dim=-1)
    student_logp = F.log_softmax(student_logits / t, dim=-1)
    kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    return kl.mean() * t * t


def learning_rate(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 50)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def save_checkpoint(path: Path, model, opt, step: int, rng: np.random.Generator) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "numpy": rng.bit_generator.state, "torch": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)  # a kill mid-save leaves the previous checkpoint whole


def distill(teacher, draft, train_ids, pool: np.ndarray, args, out: Path, log) -> dict:
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    first, ckpt = 0, out / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        rng.bit_generator.state = state["numpy"]
        torch.set_rng_state(state["torch"])
        first = state["step"]
        log(f"resumed from step {first}")
    draft.train()
    start = time.time()
    half = args.batch // 2
    for step in range(first, args.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr)
        generated = torch.from_numpy(pool[rng.integers(0, len(pool), size=args.batch - half)])
        chunk = torch.cat([corpus_windows(train_ids, half, args.seq_len, rng), generated])[:, :-1]
        with torch.no_grad():
            teacher_logits = teacher(input_ids=chunk).logits
        loss = kl_to_teacher(draft(input_ids=chunk).logits, teacher_logits, args.temperature)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            save_checkpoint(ckpt, draft, opt, step + 1, rng)
        if step % 50 == 0 or step + 1 == args.steps:
            log(f"step {step}/{args.steps} kl {loss.item():.3f} {time.time() - start:.0f}s")
    return {
        "steps": args.steps,
        "tokens_seen": args.steps * args.batch * args.seq_len,
        "train_s_last_leg": round(time.time() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", default="build/pair/target")
    parser.add_argument("--out", default="build/pair/draft")
    parser.add_argument("--layers", default="0", help="teacher layers the draft starts from, comma separated")
    parser.add_argument("--init", help="start from this draft's weights instead (a second leg of distillation)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--generations", type=int, default=512, help="target continuations to train on")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    log = run_log(out / "distill.log")
    teacher = LlamaForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.teacher)
    corpus = load_corpus()
    train_ids, val_ids = encode(tokenizer, corpus["texts"]["train"]), encode(tokenizer, corpus["texts"]["validation"])
    pool_file = out / "generations.npy"
    if pool_file.exists():
        pool = np.load(pool_file)
    else:
        t0 = time.time()
        pool = target_generations(teacher, train_ids, args.generations, 32, args.seq_len, args.seed)
        np.save(pool_file, pool)
        log(f"{len(pool)} target generations in {time.time() - t0:.0f}s")
    layers = tuple(int(x) for x in args.layers.split(","))
    if args.init:
        draft = LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        earlier = json.loads((Path(args.init) / "training.json").read_text())
        layers = tuple(earlier["teacher_layers"])
    else:
        draft = draft_from_teacher(teacher, layers)
    params = sum(p.numel() for p in draft.parameters())
    log(f"draft: {params / 1e6:.2f}M params from {args.init or f'teacher layers {layers}'}, {args.steps} steps")
    info = distill(teacher, draft, train_ids, pool, args, out, log)
    info.update(
        params=params,
        validation_loss=round(evaluate(draft, val_ids, args.seq_len), 4),
        config=shape_of(draft),
        distilled_from="target",
        teacher_layers=list(layers),
        objective=f"forward KL to the target at T={args.temperature}, half corpus windows, half target generations",
        generations=len(pool),
    )
    if args.init:  # the legs before this one
        info["earlier_legs"] = [
            *earlier.get("earlier_legs", []),
            {k: earlier[k] for k in ("steps", "tokens_seen", "train_s_last_leg", "validation_loss")},
        ]
    log(f"draft: validation loss {info['validation_loss']}")
    draft.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
