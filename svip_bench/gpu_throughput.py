"""`python -m svip_bench.gpu_throughput`: timing on a CUDA machine with models shaped like
Qwen2.5-7B (target) and Qwen2.5-0.5B (draft), random weights, bf16, built from their configs
(nothing is downloaded). Random weights accept almost nothing, so the figures are the costs, not
a speedup: a target step by batch size and tokens (what load-aware speculation fits), a draft
step, the draft/target cost ratio c, one forward's time, device kernels and aten operators with
the attention kernel SDPA chose (batch 1 and 16, through the pool's flat decoder and through the
model's own modules), what a step's sampling costs at the target's vocabulary (the warp greedy, at a
temperature and with top-p, and the draw), and the batched engine's aggregate tokens/s with
the target alone at batch 1 and 16.
Writes gpu_throughput.json and .md under --out. (--device cpu with the tiny shapes checks the
script itself where there is no GPU; CI does.)"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

# The shapes of the two Qwen2.5 checkpoints (their config.json), random weights.
SHAPES = {
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096),
}


def build(shape: str, device: str, dtype: torch.dtype = torch.bfloat16):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from svip_assets import default_pair
    from svip_common.models import LoadedModel

    config = Qwen2Config(max_position_embeddings=32768, use_sliding_window=False, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(default_pair()[0])  # ids only: the prompts are random ids below it
    return LoadedModel(f"random {shape}", model, tokenizer, config.vocab_size, config.max_position_embeddings,
                       (), token_limit=len(tokenizer))


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() (after one warm-up), synchronised with the GPU."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_costs(model, batches, tokens_per_seq, prompt: int, repeats: int) -> list[dict]:
    """One forward over `batch` sequences of `prompt` cached tokens, each adding `k` tokens."""
    from svip_common.kv_cache import KVPool

    rows = []
    pool = KVPool(model.model, (max(batches) + 1) * (prompt + max(tokens_per_seq) + 16))
    for b in batches:
        seqs = [pool.sequence() for _ in range(b)]
        pool.forward([(s, list(range(10, 10 + prompt)), 1) for s in seqs])
        for k in tokens_per_seq:
            def step():
                pool.forward([(s, list(range(20, 20 + k)), k) for s in seqs])
                for s in seqs:
                    s.rollback(prompt)
            rows.append({"batch": b, "tokens_per_seq": k, "ms": 1000 * timed(step, repeats)})
        for s in seqs:
            s.close()
    return rows


# The kernel each SDPA backend runs, as the profiler names it.
SDPA_KERNELS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
}


def forward_profile(model, batch: int, k: int, prompt: int, flat: bool = True, repeats: int = 5) -> dict:
    """One forward of ``batch`` sequences of ragged lengths adding k tokens each, through the
    pool's flat decoder (flat) or the model's own modules: its median time, and under the
    profiler the device kernels it launches (CUDA; 0 on a CPU), its aten operators, and the
    attention kernels SDPA chose (by backend: calls)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from svip_common.kv_cache import KVPool

    pool = KVPool(model.model, (batch + 1) * (prompt + k + 16), flat=flat)
    seqs = [pool.sequence() for _ in range(batch)]
    lengths = [prompt - (i % 8) for i in range(batch)]  # ragged: the masks are real
    pool.forward([(s, list(range(10, 10 + n)), 1) for s, n in zip(seqs, lengths)])

    def step():
        pool.forward([(s, list(range(20, 20 + k)), k) for s in seqs])
        synchronize()
        for s, n in zip(seqs, lengths):
            s.rollback(n)

    ms = 1e3 * timed(step, repeats)  # after a warm-up
    cuda = next(model.model.parameters()).device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
    events = prof.events()
    return {
        "batch": batch, "tokens_per_seq": k, "path": "flat decoder" if flat else "modules", "ms": ms,
        "device_kernels": sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
        "aten_ops": sum(1 for e in events if e.name.startswith("aten::")),
        "sdpa": dict(Counter(SDPA_KERNELS[e.name] for e in events if e.name in SDPA_KERNELS)),
    }


def cost_ratios(target_rows: list[dict], draft_rows: list[dict]) -> list[dict]:
    """c, the draft's step over the target's, one new token per sequence, at each batch both have."""
    target = {r["batch"]: r["ms"] for r in target_rows if r["tokens_per_seq"] == 1}
    draft = {r["batch"]: r["ms"] for r in draft_rows if r["tokens_per_seq"] == 1}
    return [{"batch": b, "c": draft[b] / target[b]} for b in sorted(target.keys() & draft.keys())]


def sampling_costs(vocab: int, device: str, repeats: int) -> list[dict]:
    """A step's sampling at this vocabulary, by rows: warp_probs greedy, at T=0.7, at T=0.7 with
    top-p 0.9 (off a CPU one sort, no host read), and sample_indices; ms each. The logits are
    random, peaked like a model's (a nucleus of tens of ids)."""
    from svip_common.contracts import SamplingParams
    from svip_common.sampling import sample_indices, warp_probs

    warps = {"greedy": SamplingParams(), "temperature 0.7": SamplingParams(temperature=0.7),
             "top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9)}
    rows = []
    for n in (1, 16, 64):
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(n)).to(device) * 6
        row = {"rows": n, **{name: timed(lambda p=params: warp_probs(logits, p), repeats) * 1e3
                             for name, params in warps.items()}}
        probs, u = warp_probs(logits, warps["top-p 0.9"]), torch.rand(n, dtype=torch.float64, device=device)
        row["draw"] = timed(lambda: sample_indices(probs, u), repeats) * 1e3
        rows.append(row)
    return rows


def engine_tps(target, draft, batch: int, policy: str, new_tokens: int, prompt: int) -> dict:
    from coordinator.engine import SpeculativeEngine
    from svip_common.contracts import GenerationRequest, PolicyConfig

    engine = SpeculativeEngine(target, draft if policy != "none" else None, kv_cache_tokens=64 * (prompt + new_tokens),
                               load_aware="greedy")
    requests = [GenerationRequest(tuple(range(100 + i, 100 + i + prompt)), new_tokens, ignore_eos=True,
                                  policy=PolicyConfig(name=policy, threshold=0.3)) for i in range(max(batch, 16))]
    engine.generate_many(requests[:2], batch)  # warm-up
    synchronize()
    start = time.perf_counter()
    results = engine.generate_many(requests, batch)
    synchronize()
    wall = time.perf_counter() - start
    return {"batch": batch, "policy": policy, "tokens_per_s": sum(len(r.token_ids) for r in results) / wall,
            "draft_tokens": sum(r.stats.draft_tokens for r in results), "pauses": sum(r.stats.pauses for r in results)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results/gpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens per sequence")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--device", default="cuda", help="cuda (default); cpu with --target-shape tiny checks the script"
    )
    parser.add_argument("--target-shape", choices=SHAPES, default="qwen2.5-7b")
    parser.add_argument("--draft-shape", choices=SHAPES, default="qwen2.5-0.5b")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device here; run it on a GPU machine (deploy/gpu-check.sh)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target, draft = build(args.target_shape, args.device, dtype), build(args.draft_shape, args.device, dtype)
    where = (
        f"{torch.cuda.get_device_name()} ({torch.cuda.device_count()} visible)"
        if args.device.startswith("cuda")
        else "CPU"
    )
    doc = {
        "command": " ".join(["python -m svip_bench.gpu_throughput", *(argv if argv is not None else sys.argv[1:])]),
        "machine": f"{where}, {platform.machine()}, torch {torch.__version__}",
        "target_step": step_costs(target, (1, 4, 16, 64), (1, 5, 9), args.prompt, args.repeats),
        "draft_step": step_costs(draft, (1, 16, 64), (1,), args.prompt, args.repeats),
        "profile": [dict(forward_profile(m, b, k, args.prompt, flat, args.repeats), model=name)
                    for name, m, k in (("target", target, 5), ("draft", draft, 1)) for b in (1, 16)
                    for flat in (True, False)],
        "sampling": sampling_costs(target.vocab_size, args.device, args.repeats),
        "engine": [
            engine_tps(target, draft, b, p, args.new_tokens, args.prompt) for b in (1, 16) for p in ("none", "svip")
        ],
    }
    doc["cost_ratio"] = cost_ratios(doc["target_step"], doc["draft_step"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_throughput.json").write_text(json.dumps(doc, indent=1))
    lines = [
        f"Command: `{doc['command']}`",
        f"Machine: {doc['machine']}",
        "",
        "| model | batch | tokens / sequence | step ms |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| target {args.target_shape} | {r['batch']} | {r['tokens_per_seq']} | {r['ms']:.2f} |"
        for r in doc["target_step"]
    ]
    lines += [
        f"| draft {args.draft_shape} | {r['batch']} | {r['tokens_per_seq']} | {r['ms']:.2f} |"
        for r in doc["draft_step"]
    ]
    lines += ["", "| draft / target step (c), one token each | batch | c |", "|---|---|---|"]
    lines += [f"| {args.draft_shape} / {args.target_shape} | {r['batch']} | {r['c']:.3f} |" for r in doc["cost_ratio"]]
    lines += ["", "| one forward | batch | tokens / sequence | path | ms | device kernels | aten operators "
              "| SDPA kernels |", "|---|---|---|---|---|---|---|---|"]
    lines += [
        f"| {r['model']} | {r['batch']} | {r['tokens_per_seq']} | {r['path']} | {r['ms']:.2f} | {r['device_kernels']} "
        f"| {r['aten_ops']} | "
        + (", ".join(f"{name} x{n}" for name, n in sorted(r["sdpa"].items())) or "none") + " |"
        for r in doc["profile"]
    ]
    lines += ["", "| sampling: vocabulary | rows | warp greedy ms | warp T=0.7 ms | warp top-p 0.9 ms | draw ms |",
              "|---|---|---|---|---|---|"]
    lines += [
        f"| {target.vocab_size} | {r['rows']} | {r['greedy']:.3f} | {r['temperature 0.7']:.3f} | {r['top-p 0.9']:.3f} "
        f"| {r['draw']:.3f} |"
        for r in doc["sampling"]
    ]
    lines += ["", "| batch | policy | tokens/s | drafted tokens | pauses |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['batch']} | {r['policy']} | {r['tokens_per_s']:.1f} | {r['draft_tokens']} | {r['pauses']} |"
        for r in doc["engine"]
    ]
    (out / "gpu_throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
