"""On a CUDA machine (deploy/gpu-check.sh runs these with `pytest -m gpu`): the batched path on
the GPU, bf16 (the pair, and the target with its feature head), each worker on a GPU of its own
through Ray's num_gpus, and a target spread over two GPUs (its KV pool's layers where the model's
layers are). Skipped where CUDA is absent, as in CI; a test that needs more GPUs than the machine
has says how many."""

from __future__ import annotations

import pytest
import torch

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig
from svip_common.models import load_model
from svip_common.pair_config import PairConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (deploy/gpu-check.sh)")]

POLICIES = [PolicyConfig(name="svip", threshold=0.6), PolicyConfig(name="constant", draft_length=4),
            PolicyConfig(name="none")]


def needs_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, this machine has {torch.cuda.device_count()}")


def requests_for(prompt_ids, n: int = 9) -> list[GenerationRequest]:
    prompts = list(prompt_ids.values())
    return [GenerationRequest(prompts[i % len(prompts)] + (i,), 12 + 5 * (i % 4), policy=POLICIES[i % len(POLICIES)],
                              ignore_eos=True) for i in range(n)]


def target_alone(target, requests) -> list[list[int]]:
    engine = SpeculativeEngine(target, None)
    return [engine.generate(r).token_ids for r in requests]


def test_the_batched_path_on_cuda_equals_one_at_a_time_and_the_target_alone(model_dirs, prompt_ids):
    target, draft = (
        load_model(model_dirs.target, "float32", "cuda"),
        load_model(model_dirs.close_draft, "float32", "cuda"),
    )
    assert target.model.device.type == "cuda"
    engine = SpeculativeEngine(target, draft, load_aware="greedy")
    requests = requests_for(prompt_ids)
    alone = target_alone(target, requests)
    assert [engine.generate(r).token_ids for r in requests] == alone
    batch = engine.batch(5)
    assert [r.token_ids for r in batch.generate_all(requests)] == alone
    assert engine.verifier.pool.keys[0].device.type == "cuda" and engine.verifier.pool.used_pages == 0


def test_bf16_on_cuda_svip_equals_the_target_alone():
    """The embedded pair in bf16 (a trained pair: its greedy choices are far from ties)."""
    from svip_assets import default_pair

    target_path, draft_path = default_pair()
    target, draft = load_model(target_path, "bfloat16", "cuda"), load_model(draft_path, "bfloat16", "cuda")
    assert target.model.dtype == torch.bfloat16
    ids = tuple(target.tokenizer("def fibonacci(n):")["input_ids"])
    engine = SpeculativeEngine(target, draft, load_aware="off")
    alone = engine.generate(GenerationRequest(ids, 48, policy=PolicyConfig(name="none"))).token_ids
    assert engine.generate(GenerationRequest(ids, 48, policy=PolicyConfig(threshold=0.4))).token_ids == alone
    batched = engine.generate_many([GenerationRequest(ids, 48, policy=PolicyConfig(threshold=0.4))] * 4, 4)
    assert all(r.token_ids == alone for r in batched)


def test_bf16_on_cuda_the_feature_head_equals_the_target_alone():
    """The embedded target with its feature head, both in bf16 on the GPU: every policy, one at a
    time and batched, equals the target alone; the head's cache and the features stay on the GPU."""
    from draft_worker.feature_draft import load_feature_draft
    from svip_assets import default_head, default_pair

    target = load_model(default_pair()[0], "bfloat16", "cuda")
    head = load_feature_draft(default_head(), target)
    assert head.head.fc.weight.device.type == "cuda" and head.head.fc.weight.dtype == torch.bfloat16
    ids = tuple(target.tokenizer("def fibonacci(n):")["input_ids"])
    engine = SpeculativeEngine(target, head, load_aware="off")
    alone = engine.generate(GenerationRequest(ids, 48, policy=PolicyConfig(name="none"))).token_ids
    for policy in (PolicyConfig(name="svip", threshold=0.6), PolicyConfig(name="constant", draft_length=4),
                   PolicyConfig(name="confidence"), PolicyConfig(name="auto")):
        result = engine.generate(GenerationRequest(ids, 48, policy=policy))
        assert result.token_ids == alone and result.stats.draft_tokens > 0, policy.name
    batched = engine.generate_many([GenerationRequest(ids, 48, policy=PolicyConfig(name="svip", threshold=0.6))] * 4, 4)
    assert all(r.token_ids == alone for r in batched)


def test_each_worker_takes_a_gpu_of_its_own(model_dirs, prompt_ids):
    """num_gpus placement: Ray gives the target and the draft one GPU each, never the same."""
    needs_gpus(2)
    import ray

    from coordinator.local import LocalDistributed

    with LocalDistributed(PairConfig(model_dirs.target, model_dirs.close_draft, device="cuda", target_gpus=1,
                                     draft_gpus=1), "async") as pair:
        target, draft = ray.get([pair.pair.target.placement.remote(), pair.pair.draft.placement.remote()])
        assert len(target["gpu_ids"]) == 1 and len(draft["gpu_ids"]) == 1
        assert target["gpu_ids"] != draft["gpu_ids"]
        assert target["devices"] == ["cuda:0"] and draft["devices"] == ["cuda:0"]  # each sees only its own
        requests = requests_for(prompt_ids, 4)
        results = pair.generate_many(requests, 4)
    assert [r.token_ids for r in results] == target_alone(load_model(model_dirs.target), requests)


def test_a_target_spread_over_two_gpus_is_exact(model_dirs, prompt_ids):
    """A target too large for one GPU: its layers over two, the KV pool's layers beside them."""
    needs_gpus(2)
    target = load_model(model_dirs.target, "float32", "cuda", spread=True)
    draft = load_model(model_dirs.close_draft, "float32", "cuda")
    engine = SpeculativeEngine(target, draft, load_aware="off")
    pool_devices = {str(k.device) for k in engine.verifier.pool.keys}
    if len(pool_devices) < 2:
        pytest.skip("device_map='auto' kept this small target on one GPU")
    requests = requests_for(prompt_ids)
    assert [r.token_ids for r in engine.generate_many(requests, 5)] == target_alone(
        load_model(model_dirs.target), requests
    )


def test_a_steps_time_is_the_devices_not_the_launch():
    """Load-aware speculation fits step costs from ``KVPool.timed_forward``: on a GPU the clock
    must stop when the kernels have run, not when they were queued. CUDA events around the same
    call bound it from below."""
    from svip_assets import default_pair
    from svip_common.kv_cache import KVPool

    target = load_model(default_pair()[0], "bfloat16", "cuda")
    pool = KVPool(target.model, 16 * 1024)
    seqs = [pool.sequence() for _ in range(16)]
    pool.forward([(s, list(range(10, 10 + 512)), 1) for s in seqs])
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        begin.record()
        _, _, seconds = pool.timed_forward([(s, list(range(20, 29)), 9) for s in seqs])
        end.record()
        end.synchronize()
        for s in seqs:
            s.rollback(512)
    assert seconds * 1e3 >= 0.9 * begin.elapsed_time(end)


def test_packed_attention_on_cuda_equals_each_sequence_alone():
    """A step's short items in one SDPA call per layer (keys gathered and masked to each item's
    own): in float32 on the GPU, each item's logits those it gets alone, with the same argmax."""
    from svip_assets import default_pair
    from svip_common.kv_cache import KVPool

    target = load_model(default_pair()[0], "float32", "cuda")
    pool = KVPool(target.model, 8192)
    prompts = [list(range(30 + i, 30 + 40 + 7 * i)) for i in range(6)]
    seqs = [pool.sequence() for _ in prompts]
    pool.forward([(s, p, 1) for s, p in zip(seqs, prompts)])
    news = [[5 + i] * (1 + i % 4) for i in range(6)]
    batched = pool.forward([(s, n, len(n)) for s, n in zip(seqs, news)])
    for p, n, rows in zip(prompts, news, batched):
        alone = pool.sequence()
        alone.forward(p, 1)
        own = alone.forward(n, len(n))
        alone.close()
        assert torch.allclose(rows, own, atol=1e-3) and torch.equal(rows.argmax(-1), own.argmax(-1))


def test_a_steps_inputs_reach_the_gpu_in_one_copy_with_their_values():
    """The pool's staging buffer on CUDA: one pinned host-to-device copy per upload, each view
    holding its part's values, a second upload into the same buffers not overwriting the first
    before its copy ran; and a pool's forwards make one copy each."""
    from svip_assets import default_pair
    from svip_common.kv_cache import KVPool, StepBuffer

    staging = StepBuffer(torch.device("cuda"))
    first = staging.upload([torch.arange(700), torch.arange(6).view(2, 3)])
    first_values = [t.cpu() for t in first]
    second = staging.upload([torch.arange(700, 0, -1), torch.zeros(2, 3, dtype=torch.long)])
    assert staging.copies == 2 and staging._host.is_pinned()
    assert torch.equal(first_values[0], torch.arange(700)) and torch.equal(first_values[1], torch.arange(6).view(2, 3))
    assert torch.equal(second[0].cpu(), torch.arange(700, 0, -1)) and not second[1].cpu().any()

    pool = KVPool(load_model(default_pair()[0], "float32", "cuda").model, 4096)
    seqs = [pool.sequence() for _ in range(4)]
    pool.forward([(s, list(range(10, 30 + i)), 1) for i, s in enumerate(seqs)])
    pool.forward([(s, [5, 6], 2) for s in seqs])
    assert pool.staging.copies == 2


def test_the_flat_decoder_on_cuda_equals_the_models_modules():
    """The pool's flat decoder on the GPU (float32, the embedded target): every step's logits
    those the model's own modules give from the same cache, to float rounding, with the same
    argmax (cuBLAS may pick another kernel for the fused q/k/v product's width, so not bitwise)."""
    from svip_assets import default_pair
    from svip_common.kv_cache import KVPool

    model = load_model(default_pair()[0], "float32", "cuda").model
    pools = [KVPool(model, 4096), KVPool(model, 4096, flat=False)]
    assert pools[0].decoder is not None and pools[1].decoder is None
    seqs = [[pool.sequence() for _ in range(4)] for pool in pools]
    prompts = [list(range(30 + i, 70 + 9 * i)) for i in range(4)]
    steps = [prompts] + [[[5 + i + j] * (1 + (i + j) % 4) for i in range(4)] for j in range(3)]
    for news in steps:
        flat, modules = (pool.forward([(s, n, min(len(n), 4)) for s, n in zip(ss, news)])
                         for pool, ss in zip(pools, seqs))
        for a, b in zip(flat, modules):
            assert torch.allclose(a, b, atol=1e-3) and torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_verify_step_on_cuda_never_takes_sdpas_math_kernel(dtype):
    """Masked, grouped-head attention (a packed verify step, a lone prefill): the keys and values
    are expanded to every head on CUDA (svip_common/attention.py), so SDPA picks a fused kernel."""
    from torch.profiler import ProfilerActivity, profile

    from svip_assets import default_pair
    from svip_bench.gpu_throughput import SDPA_KERNELS
    from svip_common.kv_cache import KVPool

    pool = KVPool(load_model(default_pair()[0], dtype, "cuda").model, 8192)
    seqs = [pool.sequence() for _ in range(4)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pool.forward([(s, list(range(10, 50 + 7 * i)), 1) for i, s in enumerate(seqs)])  # prefills, alone
        pool.forward([(s, [5, 6, 7, 8], 4) for s in seqs])  # one packed, masked call per layer
        torch.cuda.synchronize()
    kernels = {SDPA_KERNELS[e.name] for e in prof.events() if e.name in SDPA_KERNELS}
    assert kernels and "math" not in kernels, kernels


def test_a_prefill_from_nothing_on_cuda_takes_flash_with_grouped_heads(monkeypatch):
    """A prompt prefilled from nothing is attended with is_causal, no mask (svip_common/attention.py):
    in bf16 SDPA runs its flash kernel on the grouped heads, nothing expanded; its logits equal
    the masked call's within bf16 rounding, with the same argmax."""
    from torch.profiler import ProfilerActivity, profile

    from svip_assets import default_pair
    from svip_bench.gpu_throughput import SDPA_KERNELS
    from svip_common import kv_cache
    from svip_common.kv_cache import KVPool

    pool = KVPool(load_model(default_pair()[0], "bfloat16", "cuda").model, 8192)
    prompts = [list(range(10, 60 + 9 * i)) for i in range(3)]  # longer than a packed item: alone
    seqs = [pool.sequence() for _ in prompts]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        causal = pool.forward([(s, p, 1) for s, p in zip(seqs, prompts)])
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert {SDPA_KERNELS[n] for n in names if n in SDPA_KERNELS} == {"flash"}
    assert not any("repeat_interleave" in n for n in names)
    for s in seqs:
        s.rollback(0)
    monkeypatch.setattr(kv_cache._Item, "causal", property(lambda self: False))  # the lower-right mask, as before
    masked = pool.forward([(s, p, 1) for s, p in zip(seqs, prompts)])
    for a, b in zip(causal, masked):
        assert torch.allclose(a.float(), b.float(), atol=5e-2) and torch.equal(a.argmax(-1), b.argmax(-1))


def test_top_p_on_cuda_sorts_once_reads_nothing_and_keeps_the_cpus_nucleus():
    """Off a CPU the top-p filter sorts once and never reads the host (svip_common/sampling.py: a
    read would wait for the device); its kept ids are those the CPU's candidate search keeps."""
    from torch.profiler import ProfilerActivity, profile

    from svip_common.contracts import SamplingParams
    from svip_common.sampling import warp_probs

    scales = torch.logspace(1.2, -1.5, 16)
    logits = torch.randn(16, 32000, generator=torch.Generator().manual_seed(5)) * scales[:, None]
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
    on_cpu = warp_probs(logits, params)
    warp_probs(logits.cuda(), params)  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        on_gpu = warp_probs(logits.cuda(), params)
    assert not any(e.name == "aten::_local_scalar_dense" for e in prof.events())
    on_gpu = on_gpu.cpu()
    differ = ((on_gpu > 0) != (on_cpu > 0)).sum(-1)
    assert int(differ.max()) <= 1, differ  # a parallel cumsum may round one boundary id the other way
    same = differ == 0
    assert int(same.sum()) >= len(same) - 2, differ
    assert torch.allclose(on_gpu[same], on_cpu[same], rtol=1e-4, atol=1e-7)
