"""One step of a tensor-parallel target, timed at each degree, beside what the planner predicts.

    python -m svip_bench.tp_step [--target DIR] [--degrees 1,2] [--batches 1,8] [--context 200]
                                 [--repeats 20] [--device cpu] [--planned-on h100] [--dtype float32]

For each degree (1: the whole model; N: rank 0 of N ranks, the others threads of this process,
svip_common/tensor_parallel.py), each batch and each step shape (decode: one new token a session;
verify: five), B sessions prefilled to --context tokens, then the step run --repeats times (each
rolled back): the median wall time on this machine, and the step model's time for the same shape
on N of --planned-on's devices (svip_common/device_profile.py, what `svip plan` times), so that a
GPU run checks the planner's tensor-parallel model against the product's. On this two-core CPU
the ranks share two cores: a degree past 1 is slower here, by design of the machine, not the code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from svip_assets import default_pair
from svip_bench.forward_step import sessions, step
from svip_bench.overhead import machine
from svip_common.device_profile import DEVICES, DTYPE_BYTES, ModelShape, StepModel
from svip_common.kv_cache import KVPool
from svip_common.models import DTYPES, load_model

SHAPES = {"decode": 1, "verify": 5}


def measure(path: str, degree: int, batches: list[int], context: int, repeats: int, dtype: str,
            device: str) -> list[dict]:
    ranks = None
    if degree > 1:
        from svip_common.tensor_parallel import LocalRanks

        ranks = LocalRanks(path, degree, DTYPES[dtype], device)
    model = load_model(path, dtype, device, group=None if ranks is None else ranks.group)
    rows = []
    for batch in batches:
        pool = KVPool(model.model, tokens=batch * (context + 64))
        seqs = sessions(pool, batch, context, model.token_limit)
        for shape, new in SHAPES.items():
            for _ in range(3):
                step(pool, seqs, new)  # warm-up
            times = [step(pool, seqs, new) for _ in range(repeats)]
            rows.append({"degree": degree, "batch": batch, "shape": shape, "new": new,
                         "median_ms": 1e3 * statistics.median(times)})
        pool.close()
    if ranks is not None:
        ranks.close()
    return rows


def predicted_ms(path: str, degree: int, batch: int, new: int, context: int, device: str, dtype: str) -> float:
    config = json.loads((Path(path) / "config.json").read_text())
    model = StepModel(ModelShape.from_config(Path(path).name, config), DEVICES[device], degree,
                      DTYPE_BYTES.get(dtype, 2))
    return 1e3 * model.forward_s([(new, context)] * batch)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=default_pair()[0])
    p.add_argument("--degrees", default="1,2")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--planned-on", default="h100", choices=sorted(DEVICES))
    args = p.parse_args(argv)
    degrees = [int(d) for d in args.degrees.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    rows = [row for degree in degrees for row in measure(args.target, degree, batches, args.context, args.repeats,
                                                          args.dtype, args.device)]
    print(f"Command: python -m svip_bench.tp_step {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"Machine: {machine()}; the target {args.target}, {args.dtype} on {args.device}; context {args.context}")
    print()
    print(f"| degree | batch | step | measured here, ms | planned on degree x {args.planned_on} (bf16), ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        planned = predicted_ms(args.target, r["degree"], r["batch"], r["new"], args.context, args.planned_on,
                               "bfloat16")
        print(f"| {r['degree']} | {r['batch']} | {r['shape']} | {r['median_ms']:.2f} | {planned:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
