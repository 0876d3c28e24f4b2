"""A driver on a node of a Ray cluster (RAY_ADDRESS): places a worker pair packed or spread over
the nodes, runs a batch of requests through it in each pipeline mode, interleaved, and prints
one JSON object: where the workers listen, every output's token ids and stats. The two-node
test and `svip bench --mode pipeline --two-nodes` run it inside a node's network namespace.

    python -m svip_bench.cluster_run SPEC.json     (SPEC: see ``run``)
"""

from __future__ import annotations

import asyncio
import json
import random
import sys


def run(spec: dict) -> dict:
    """spec: target, draft, layout ("pack" / "spread"), modes, requests (list of {prompt_ids,
    max_new_tokens, policy: PolicyConfig fields}), repeats, warmup, tls_dir (optional), hold
    (print the result, then keep the workers up until a line arrives on stdin)."""
    import ray

    from coordinator.cluster import WorkerPair
    from coordinator.distributed import DistributedEngine
    from svip_common.contracts import GenerationRequest, PolicyConfig
    from svip_common.pair_config import PairConfig

    ray.init(address="auto", log_to_driver=False)
    pair = WorkerPair(PairConfig(spec["target"], spec["draft"], layout=spec.get("layout", "spread"),
                                 grpc_tls_dir=spec.get("tls_dir"), insecure_workers=bool(spec.get("insecure_workers"))))
    loop = asyncio.new_event_loop()
    engines = {m: DistributedEngine.for_pair(pair, m) for m in spec["modes"]}
    requests = [
        GenerationRequest(
            tuple(r["prompt_ids"]),
            r["max_new_tokens"],
            policy=PolicyConfig(**r.get("policy", {})),
            ignore_eos=r.get("ignore_eos", False),
        )
        for r in spec["requests"]
    ]
    out = {
        "target_address": pair.target_address,
        "draft_address": pair.draft_address,
        "node_ip": ray.util.get_node_ip_address(),
        "outputs": {m: [] for m in engines},
        "stats": {m: [] for m in engines},
    }
    try:
        for engine in engines.values():
            loop.run_until_complete(engine.connect())
        for request in requests[: spec.get("warmup", 0)]:
            for engine in engines.values():
                loop.run_until_complete(engine.generate(request))
        rng = random.Random(0)
        for _ in range(spec.get("repeats", 1)):
            for request in requests:
                for mode in rng.sample(list(engines), len(engines)):  # interleaved, in shuffled order
                    result = loop.run_until_complete(engines[mode].generate(request))
                    out["outputs"][mode].append(result.token_ids)
                    out["stats"][mode].append(result.stats.to_dict())
        if spec.get("hold"):
            print("RESULT " + json.dumps(out), flush=True)
            sys.stdin.readline()
    finally:
        for engine in engines.values():
            loop.run_until_complete(engine.close())
        pair.shutdown()
        ray.shutdown()
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = run(spec)
    if not spec.get("hold"):
        print("RESULT " + json.dumps(result))
