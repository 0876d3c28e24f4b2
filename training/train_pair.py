"""Train the embedded draft/target pair on the Python standard library's own source.

    python training/train_pair.py --out build/pair --target-steps N --draft-steps M

Every machine with Python has the corpus: the stdlib's .py files (its docstrings and comments
give English too) plus pydoc's topic texts. Files are split by a hash of their path: 90% train,
5% validation, 5% held-out test (the benchmark's `code` category reads the test list from
split.json). A byte-level BPE tokenizer is trained on the training split and saved beside each
model, so loading goes through the same from_pretrained path as any real model.

Seeded and step-budgeted (not time-budgeted), so a rerun on the same machine reproduces. This is
the CPU path, which made the first embedded pair; the shipped pair came from training/accelerated.py
(one time-boxed GPU run on this split plus permissively licensed packages, same tokenizer).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
SIZES = {
    "target": dict(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, intermediate_size=704
    ),
    # the accelerator-trained target (training/accelerated.py): deeper, same width, so a draft made
    # of a few of its layers (training/distill.py draft_from_teacher) starts from its representation
    "target-deep": dict(
        hidden_size=256, num_hidden_layers=10, num_attention_heads=8, num_key_value_heads=4, intermediate_size=768
    ),
    "draft": dict(
        hidden_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256
    ),
}


def corpus_files() -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idle_test")
    files = [p for p in lib.rglob("*.py") if not any(part in skip for part in p.relative_to(lib).parts)]
    return sorted(files, key=lambda p: str(p.relative_to(lib)))


def split_of(relative: str) -> str:
    bucket = int(hashlib.sha1(relative.encode()).hexdigest(), 16) % 20
    return "validation" if bucket == 0 else "test" if bucket == 1 else "train"


def load_corpus() -> dict[str, list[str]]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts: dict[str, list[str]] = {"train": [], "validation": [], "test": []}
    names: dict[str, list[str]] = {"train": [], "validation": [], "test": []}
    for path in corpus_files():
        rel = str(path.relative_to(lib))
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts[split_of(rel)].append(text)
        names[split_of(rel)].append(rel)
    import pydoc_data.topics

    texts["train"].extend(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return {"texts": texts, "names": names}


# A code model's chat: the conversation as Python comments, the reply starting on a fresh line.
CHAT_TEMPLATE = (
    "{% for message in messages %}# {{ message['role'] }}: {{ message['content'] | replace('\\n', '\\n# ') }}\n"
    "{% endfor %}{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, chat_template=CHAT_TEMPLATE)


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    ids: list[int] = []
    for enc in tokenizer(texts)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.eos_token_id)
    return np.asarray(ids, dtype=np.uint16)


def build(kind: str, vocab: int, eos: int, seq_len: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=eos,
        **SIZES[kind],
    )
    return LlamaForCausalLM(config)


def batches(data: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
        chunk = np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(chunk)


@torch.no_grad()
def evaluate(model, data: np.ndarray, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token cross-entropy (nats/token) over consecutive held-out windows."""
    was_training = model.training
    model.eval()
    n = min(max_windows, (len(data) - 1) // seq_len)
    losses = []
    for i in range(n):
        chunk = torch.from_numpy(data[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64))[None]  # [1, L + 1]
        chunk = chunk.to(model.device)
        logits = model(input_ids=chunk[:, :-1]).logits.float()  # [1, L, vocab]
        losses.append(float(torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:])))
    model.train(was_training)
    return float(np.mean(losses))


def train(model, data, steps: int, batch: int, seq_len: int, lr: float, seed: int, log) -> dict:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 50)
    model.train()
    start = time.time()
    stream = batches(data, batch, seq_len, rng)
    for step in range(steps):
        scale = (
            (step + 1) / warmup
            if step < warmup
            else 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
        )
        for group in opt.param_groups:
            group["lr"] = lr * (0.1 + 0.9 * scale)
        chunk = next(stream)
        logits = model(input_ids=chunk[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        loss = loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step}/{steps} loss {loss.item():.3f} {time.time() - start:.0f}s")
    return {"steps": steps, "tokens_seen": steps * batch * seq_len, "train_s": round(time.time() - start, 1)}


def run_log(path: Path):
    """A log function that prints each line with its time and appends it to path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    logfile = open(path, "a")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        logfile.write(line + "\n")
        logfile.flush()

    return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/pair")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--target-steps", type=int, default=3000)
    parser.add_argument("--draft-steps", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["target", "draft"], help="train one model (the tokenizer is reused)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    log = run_log(out / "train.log")
    corpus = load_corpus()
    tok_dir = out / "tokenizer"
    if tok_dir.exists():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    else:
        tokenizer = train_tokenizer(corpus["texts"]["train"], args.vocab)
        tokenizer.save_pretrained(tok_dir)
        (out / "split.json").write_text(json.dumps(corpus["names"], indent=1))
    train_ids = encode(tokenizer, corpus["texts"]["train"])
    val_ids = encode(tokenizer, corpus["texts"]["validation"])
    log(f"corpus: {len(train_ids)} train tokens, {len(val_ids)} validation tokens, vocab {len(tokenizer)}")
    for kind in ("target", "draft"):
        if args.only and kind != args.only:
            continue
        steps = args.target_steps if kind == "target" else args.draft_steps
        model = build(kind, len(tokenizer), tokenizer.eos_token_id, args.seq_len)
        params = sum(p.numel() for p in model.parameters())
        log(f"{kind}: {params / 1e6:.2f}M params, {steps} steps")
        info = train(model, train_ids, steps, args.batch, args.seq_len, args.lr, args.seed, log)
        info.update(params=params, validation_loss=round(evaluate(model, val_ids, args.seq_len), 4), config=SIZES[kind])
        log(f"{kind}: validation loss {info['validation_loss']}")
        model.to(torch.bfloat16).save_pretrained(out / kind)
        tokenizer.save_pretrained(out / kind)
        (out / kind / "training.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
