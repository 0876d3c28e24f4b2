"""Train the embedded pair on an accelerator in one short, time-boxed run.

    python -m training.accelerated prepare --out build/gpu_in           # here: the corpus, tokenized
    python -m training.accelerated train --data build/gpu_in --out DIR  # on the GPU machine

`prepare` tokenizes, with the shipped tokenizer, the standard library's training split (the same
files as `training/train_pair.py`) plus the Python sources of permissively licensed packages
installed beside this project, and records each source's license and token count. The validation
split stays the stdlib's, so losses compare with the CPU-trained pair's. The arrays travel to the
accelerator machine, whose own Python and packages differ, so both machines train on one corpus.

`train` runs on CUDA when present (on the CPU otherwise, which is how the tests run it): the target
for --target-s seconds (a cosine schedule sized from the measured step time, capped at --max-epochs
passes; the weights with the best validation loss are kept), then the target's own sampled
continuations, then each draft distilled from it (forward KL, half corpus windows and half those
continuations, as `training/distill.py` does on the CPU) for --draft-s seconds each. It writes a
pair directory in the shipped layout: target/, one draft directory per --drafts entry, split.json.

A rerun with the same --out resumes: each phase that finished is kept (the target's directory, the
sampled continuations, each draft's directory), and the phase that was cut off continues from its
checkpoint in OUT/checkpoints (written every --checkpoint-every-s seconds: weights, optimiser, step
plan, time spent, best weights, random states), so a long run survives an interruption.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import math
import os
import shutil
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from training.distill import corpus_windows, draft_from_teacher, kl_to_teacher, shape_of, target_generations
from training.train_pair import SIZES, build, encode, evaluate, load_corpus, run_log

# Import name -> distribution name; every one is under a permissive license, read from its metadata.
PACKAGES = {
    "torch": "torch", "ray": "ray", "numpy": "numpy", "scipy": "scipy", "sympy": "sympy",
    "networkx": "networkx", "pydantic": "pydantic", "setuptools": "setuptools", "aiohttp": "aiohttp",
    "jinja2": "jinja2", "requests": "requests", "urllib3": "urllib3", "starlette": "starlette",
    "fastapi": "fastapi",
}
SKIP_PARTS = {"tests", "test", "testing", "_vendor", "vendored", "__pycache__"}
MAX_FILE_BYTES = 400_000  # larger .py files are generated tables, not code anyone writes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def license_of(distribution: str) -> str:
    meta = importlib.metadata.metadata(distribution)
    expression = meta.get("License-Expression") or ""
    if expression:
        return expression
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    return ", ".join(classifiers) or (meta.get("License") or "").splitlines()[0]


def package_texts(name: str) -> list[str]:
    root = Path(sysconfig.get_paths()["purelib"]) / name
    texts = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_PARTS & set(path.relative_to(root).parts) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def prepare(tokenizer_dir: Path, out: Path, packages: list[str]) -> None:
    """Tokenize the corpus into out/corpus.npz (uint16 train, validation) and describe it in out/sources.json."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    corpus = load_corpus()
    parts = [encode(tokenizer, corpus["texts"]["train"])]
    sources = [{"source": f"CPython {sysconfig.get_python_version()} standard library (training split)",
                "license": "PSF-2.0", "files": len(corpus["texts"]["train"]), "tokens": int(len(parts[0]))}]
    for name in packages:
        dist = PACKAGES[name]
        texts = package_texts(name)
        parts.append(encode(tokenizer, texts))
        sources.append({"source": f"{dist} {importlib.metadata.version(dist)}", "license": license_of(dist),
                        "files": len(texts), "tokens": int(len(parts[-1]))})
        print(sources[-1], flush=True)
    validation = encode(tokenizer, corpus["texts"]["validation"])
    np.savez_compressed(out / "corpus.npz", train=np.concatenate(parts), validation=validation)
    (out / "sources.json").write_text(json.dumps(sources, indent=1))


def cosine(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 50)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup)))))


def bf16_on_cuda(device):
    """Mixed precision where it pays (CUDA); a no-op on the CPU, where bf16 matmuls are slow."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


class Fit:
    """A time-boxed optimisation loop: the step count comes from the budget and the measured step time.

    With a checkpoint path it saves its whole state (weights, optimiser, step plan, time spent, best
    weights so far, random states) every every_s seconds, atomically, and a rerun resumes from it:
    an interrupted run loses at most that interval and keeps its plan and its budget."""

    def __init__(self, model, device, lr: float, budget_s: float, max_steps: int, log, rng: np.random.Generator,
                 checkpoint: Path | None = None, every_s: float = 60.0):
        self.model, self.device, self.lr, self.log, self.rng = model, device, lr, log, rng
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                                     fused=device.type == "cuda")
        self.budget_s, self.max_steps = budget_s, max_steps
        self.checkpoint, self.every_s = checkpoint, every_s

    def autocast(self):
        return bf16_on_cuda(self.device)

    def elapsed(self, start: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.time() - start

    def save(self, state: dict) -> None:
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint.with_suffix(".tmp")
        torch.save({**state, "model": self.model.state_dict(), "opt": self.opt.state_dict(),
                    "numpy": self.rng.bit_generator.state, "torch": torch.get_rng_state()}, tmp)
        os.replace(tmp, self.checkpoint)  # a kill mid-save leaves the previous checkpoint whole

    def resume(self) -> dict:
        state = {"step": 0, "steps": self.max_steps, "spent": 0.0, "planned": False, "best": (float("inf"), -1, None)}
        if self.checkpoint is None or not self.checkpoint.exists():
            return state
        saved = torch.load(self.checkpoint, weights_only=False, map_location=self.device)
        self.model.load_state_dict(saved.pop("model"))
        self.opt.load_state_dict(saved.pop("opt"))
        self.rng.bit_generator.state = saved.pop("numpy")
        torch.set_rng_state(saved.pop("torch").cpu())
        self.log(f"resumed at step {saved['step']} of {saved['steps']} ({saved['spent']:.0f}s spent)")
        return saved

    def run(self, loss_of, evaluate_every: int = 0, validate=None) -> dict:
        """loss_of(step) -> loss tensor; validate() -> float, run every evaluate_every steps (best kept).

        The step count is planned from the pace after a warm-up (the first steps pay for allocation and
        kernel selection), and planned again a tenth of the way in, so the run ends near its budget."""
        self.model.train()
        state = self.resume()
        step, steps, best = state["step"], state["steps"], state["best"]
        start = time.time() - state["spent"]
        warm, replan = step + 10, [] if state["planned"] else [step + 30]
        saved_at = time.time()
        while step < steps:
            for group in self.opt.param_groups:
                group["lr"] = cosine(step, steps, self.lr)
            with self.autocast():
                loss = loss_of(step)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            step += 1
            if step == warm:
                warm_at = self.elapsed(start)
            if replan and step == replan[0]:
                now = self.elapsed(start)
                per_step = (now - warm_at) / (step - warm)
                steps = max(step + 1, min(self.max_steps, step + int((self.budget_s - now) / per_step)))
                replan = [steps // 10] if steps // 10 > step and not state["planned"] else []
                state["planned"] = True
                self.log(f"{per_step * 1000:.1f} ms/step -> {steps} steps")
            if validate and (step % max(1, evaluate_every or steps // 8) == 0 or step == steps):
                value = validate()
                if value < best[0]:
                    best = (value, step, copy.deepcopy(self.model.state_dict()))
                elapsed = time.time() - start
                self.log(f"step {step}/{steps} loss {loss.item():.3f} validation {value:.4f} {elapsed:.0f}s")
            elif step % 200 == 0 or step == steps:
                self.log(f"step {step}/{steps} loss {loss.item():.3f} {time.time() - start:.0f}s")
            if self.checkpoint is not None and (time.time() - saved_at >= self.every_s or step == steps):
                self.save(
                    {"step": step, "steps": steps, "spent": time.time() - start, "planned": not replan, "best": best}
                )
                saved_at = time.time()
        if best[2] is not None:
            self.model.load_state_dict(best[2])
        return {
            "steps": steps,
            "train_s": round(time.time() - start, 1),
            "best_step": best[1],
            "best_validation": None if best[2] is None else round(best[0], 4),
        }


def train_target(train_ids, val_ids, vocab: int, eos: int, args, device, log) -> tuple[LlamaForCausalLM, dict]:
    torch.manual_seed(args.seed)
    model = build(args.size, vocab, eos, args.seq_len).to(device)
    rng = np.random.default_rng(args.seed)
    per_step = args.batch * args.seq_len
    max_steps = max(1, int(args.max_epochs * len(train_ids) / per_step))
    fit = Fit(
        model,
        device,
        args.lr,
        args.target_s,
        max_steps,
        log,
        rng,
        checkpoints(args) / "target.pt",
        args.checkpoint_every_s,
    )

    def loss_of(step):
        chunk = corpus_windows(train_ids, args.batch, args.seq_len, rng).to(device)
        logits = model(input_ids=chunk[:, :-1]).logits.float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))

    def validate():
        with fit.autocast():
            return evaluate(model, val_ids, seq_len=256, max_windows=64)

    info = fit.run(loss_of, validate=validate)
    info.update(
        tokens_seen=info["steps"] * per_step,
        epochs=round(info["steps"] * per_step / len(train_ids), 2),
        params=sum(p.numel() for p in model.parameters()),
        config=SIZES[args.size],
    )
    return model.eval(), info


def checkpoints(args) -> Path:
    return Path(args.checkpoint_dir) if args.checkpoint_dir else Path(args.out) / "checkpoints"


def distill_draft(
    teacher,
    name: str,
    layers: tuple[int, ...],
    train_ids,
    pool: np.ndarray,
    args,
    device,
    log,
    start: Path | None = None,
) -> tuple[LlamaForCausalLM, dict]:
    """A draft of the teacher's chosen layers, or (start) a finished draft taken further: a second leg."""
    torch.manual_seed(args.seed)
    if start is None:
        draft = draft_from_teacher(teacher, layers).to(device)
    else:
        draft = LlamaForCausalLM.from_pretrained(start, dtype=torch.float32).to(device)
        earlier = json.loads((start / "training.json").read_text())
        layers = tuple(earlier["teacher_layers"])
    rng = np.random.default_rng(args.seed)
    half = args.batch // 2
    fit = Fit(
        draft,
        device,
        args.draft_lr,
        args.draft_s,
        10**9,
        log,
        rng,
        checkpoints(args) / f"{name}.pt",
        args.checkpoint_every_s,
    )

    def loss_of(step):
        generated = torch.from_numpy(pool[rng.integers(0, len(pool), size=args.batch - half)]).to(device)
        chunk = torch.cat([corpus_windows(train_ids, half, args.seq_len, rng).to(device), generated])[:, :-1]
        with torch.no_grad():
            teacher_logits = teacher(input_ids=chunk).logits.float()
        return kl_to_teacher(draft(input_ids=chunk).logits.float(), teacher_logits, 1.0)

    info = fit.run(loss_of)
    info.update(
        tokens_seen=info["steps"] * args.batch * args.seq_len,
        train_s_last_leg=info.pop("train_s"),
        params=sum(p.numel() for p in draft.parameters()),
        teacher_layers=list(layers),
        distilled_from="target",
        objective="forward KL to the target at T=1.0, half corpus windows, half target generations",
        generations=len(pool),
    )
    if start is not None:
        keep = ("steps", "tokens_seen", "train_s_last_leg", "validation_loss", "device")
        info["earlier_legs"] = [*earlier.get("earlier_legs", []), {k: earlier[k] for k in keep if k in earlier}]
    info["config"] = shape_of(draft)
    return draft.eval(), info


def save(model, info: dict, tokenizer_dir: Path, out: Path) -> None:
    copy.deepcopy(model).to("cpu", torch.bfloat16).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    (out / "training.json").write_text(json.dumps(info, indent=1))


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def train(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    out, tokenizer_dir = Path(args.out), Path(args.tokenizer)
    log = run_log(out / "train.log")
    data = np.load(Path(args.data) / "corpus.npz")
    train_ids, val_ids = data["train"], data["validation"]
    sources = json.loads((Path(args.data) / "sources.json").read_text())
    shipped = json.loads((tokenizer_dir / "config.json").read_text())  # the vocabulary the shipped pair uses
    vocab, eos = shipped["vocab_size"], shipped["eos_token_id"]
    trained_on = {
        "device": device_name(device),
        "torch": torch.__version__,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "corpus": sources,
    }
    log(f"{device_name(device)}: {len(train_ids)} train tokens, {len(val_ids)} validation tokens, vocab {vocab}")
    shutil.copy(Path(args.split), out / "split.json")
    if args.teacher or (out / "target" / "training.json").exists():  # distill only, from a target trained before
        teacher = Path(args.teacher or out / "target")
        target = LlamaForCausalLM.from_pretrained(teacher, dtype=torch.float32).to(device).eval()
        if teacher.resolve() != (out / "target").resolve():
            shutil.copytree(teacher, out / "target", dirs_exist_ok=True)
        log(f"target from {teacher}")
    else:
        target, info = train_target(train_ids, val_ids, vocab, eos, args, device, log)
        info.update(trained_on)
        log(
            f"target: {info['params'] / 1e6:.2f}M params, best validation {info['best_validation']} "
            f"at step {info['best_step']}"
        )
        save(target, info, tokenizer_dir, out / "target")
    pool_file = checkpoints(args) / "generations.npy"
    if pool_file.exists():
        pool = np.load(pool_file)
    else:
        t0 = time.time()
        pool = target_generations(
            target, train_ids, args.generations, 32, args.seq_len, args.seed, device=device, batch=args.generation_batch
        )
        log(f"{len(pool)} target generations in {time.time() - t0:.0f}s")
        pool_file.parent.mkdir(parents=True, exist_ok=True)
        np.save(pool_file, pool)
    for p in target.parameters():
        p.requires_grad_(False)
    for name, layers in zip(args.draft_names, args.drafts):
        if (out / name / "training.json").exists():
            log(f"{name} already distilled")
            continue
        start = Path(args.init) / name if args.init else None
        draft, dinfo = distill_draft(
            target, name, tuple(int(x) for x in layers.split(",")), train_ids, pool, args, device, log, start
        )
        with bf16_on_cuda(device):
            dinfo["validation_loss"] = round(evaluate(draft, val_ids, seq_len=256, max_windows=64), 4)
        dinfo.update(trained_on)
        log(
            f"{name}: {dinfo['params'] / 1e6:.2f}M params, {dinfo['steps']} steps, "
            f"validation {dinfo['validation_loss']}"
        )
        save(draft, dinfo, tokenizer_dir, out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="tokenize the corpus here")
    prep.add_argument("--out", default="build/gpu_in")
    prep.add_argument("--tokenizer", default="svip_assets/pair/target")
    prep.add_argument("--packages", default=",".join(PACKAGES), help="comma separated, from: " + ", ".join(PACKAGES))
    run = sub.add_parser("train", help="train the pair (CUDA when present)")
    run.add_argument("--data", default="build/gpu_in")
    run.add_argument("--out", default="build/gpu_pair")
    run.add_argument("--tokenizer", default="svip_assets/pair/target")
    run.add_argument("--split", default="svip_assets/pair/split.json")
    run.add_argument(
        "--teacher", help="a trained target directory: skip training the target, distill the drafts from it"
    )
    run.add_argument("--init", help="a pair directory: each draft continues from its namesake there (a second leg)")
    run.add_argument("--size", default="target-deep", choices=sorted(SIZES))
    run.add_argument("--target-s", type=float, default=240.0)
    run.add_argument("--max-epochs", type=float, default=10.0)
    run.add_argument("--draft-s", type=float, default=60.0, help="seconds per draft")
    run.add_argument("--drafts", nargs="+", default=["0"], help="teacher layers each draft starts from, e.g. 0 0,9")
    run.add_argument("--draft-names", nargs="+", default=["draft"])
    run.add_argument("--batch", type=int, default=128)
    run.add_argument("--seq-len", type=int, default=512)
    run.add_argument("--lr", type=float, default=2e-3)
    run.add_argument("--draft-lr", type=float, default=2e-3)
    run.add_argument("--generations", type=int, default=2048)
    run.add_argument("--generation-batch", type=int, default=1024)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--checkpoint-dir", help="where the resumable state goes (default OUT/checkpoints)")
    run.add_argument("--checkpoint-every-s", type=float, default=60.0)
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(Path(args.tokenizer), Path(args.out), [p for p in args.packages.split(",") if p])
    else:
        if len(args.drafts) != len(args.draft_names):
            parser.error("--drafts and --draft-names need one name per draft")
        train(args)


if __name__ == "__main__":
    main()
