"""A target larger than one device, as tensor-parallel ranks (issue 61; svip_common/tensor_parallel.py):
on this CPU, gloo and two ranks, the second a thread of the test's process following rank 0's steps.
Each rank holds half of every layer, of the vocabulary's rows and of the KV cache; degree 2 gives
degree 1's logits to float32's rounding and its greedy tokens; greedy output equals the target
alone at degree 2 in every mode (in process, batched, trees, both pipelines through the in-memory
transport, the feature head), and sampled output follows it. A degree the model does not divide is
refused at load by name."""

from __future__ import annotations

import pytest
import torch

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, Limits, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.kv_cache import KVPool
from svip_common.models import load_model
from svip_common.tensor_parallel import LocalRanks
from tests.integration.test_in_memory import DRAFT_FIRST, TARGET_FIRST
from tests.integration.test_sampling_exact import ALPHA, chi_square_pvalue
from tests.policies import POLICIES, TREE_POLICIES
from tests.tolerances import float32_tolerance

MAX_NEW = 24


def _at_degree_two(path: str):
    """Rank 0 of the model at degree 2; its rank 1 a thread that follows it, stopped at the end."""
    ranks = LocalRanks(path, 2)
    yield load_model(path, group=ranks.group)
    ranks.close()
    assert not ranks.errors and not any(thread.is_alive() for thread in ranks.threads)


@pytest.fixture(scope="module")
def tp_target(model_dirs):
    yield from _at_degree_two(model_dirs.target)


def test_degree_two_gives_degree_ones_logits_and_tokens(models, tp_target, prompt_ids):
    """Prefill, decode, a fork written after (copy on write) and a tree's path kept (slots moved):
    every row within float32's rounding of the whole model's, and the same argmax."""
    whole, shard = KVPool(models["target"].model, 512), KVPool(tp_target.model, 512)
    config = models["target"].model.config
    for pool_rows in ((whole.sequence(), shard.sequence()),):
        a, b = pool_rows
        ids = list(prompt_ids["long"])
        rows = [(a.forward(ids, len(ids)), b.forward(ids, len(ids)))]
        fa, fb = a.fork(), b.fork()
        fa.rollback(5)
        fb.rollback(5)
        rows.append((fa.forward([5, 6, 7], 3), fb.forward([5, 6, 7], 3)))
        for seq in (a, b):  # a tree's step: a spine token and its sibling, then the sibling kept
            seq.pool.forward([(seq, [9, 11], 2, [-1, -1])])
            seq.keep_path(len(ids), 1, 0, [1])
        rows.append((a.forward([12], 1), b.forward([12], 1)))
        for expected, got in rows:
            tolerance = float32_tolerance(config, expected.flatten().tolist())
            assert (expected - got).abs().max() <= tolerance
            assert torch.equal(expected.argmax(-1), got.argmax(-1))
    shard.close()


def test_a_rank_holds_half_the_weights_and_half_the_kv_cache(models, tp_target):
    whole = sum(p.numel() * p.element_size() for p in models["target"].model.parameters())
    half = sum(p.numel() * p.element_size() for p in tp_target.model.parameters())
    pool_whole, pool_half = KVPool(models["target"].model, 512), KVPool(tp_target.model, 512)
    assert half / whole <= 0.55 and pool_half.nbytes / pool_whole.nbytes <= 0.55
    pool_half.close()


@pytest.fixture(scope="module")
def tp_draft(model_dirs):
    """The close draft at degree 2: its own group beside the target's."""
    yield from _at_degree_two(model_dirs.close_draft)


def requests(prompt_ids, policies, sampling=SamplingParams()) -> list[GenerationRequest]:
    return [GenerationRequest(ids, MAX_NEW, sampling, policy, ignore_eos=True)
            for ids in prompt_ids.values() for policy in policies]


def test_greedy_equals_the_target_alone_at_degree_two_in_process_and_batched(models, tp_target, prompt_ids):
    asked = requests(prompt_ids, [POLICIES["svip"], TREE_POLICIES["svip-cape"], TREE_POLICIES["svip-deep"]])
    alone = SpeculativeEngine(tp_target, None)
    expected = [alone.generate(r).token_ids for r in asked]
    engine = SpeculativeEngine(tp_target, models["close_draft"], load_aware="off")
    results = [engine.generate(r) for r in asked]
    assert [r.token_ids for r in results] == expected and sum(r.stats.accepted_tokens for r in results) > 0
    assert [r.token_ids for r in engine.generate_many(asked, len(asked))] == expected
    whole = SpeculativeEngine(models["target"], None)
    assert expected == [whole.generate(r).token_ids for r in asked]  # degree 1's greedy tokens too


@pytest.mark.parametrize("pipeline", ["sync", "async"])
@pytest.mark.parametrize("schedule", ["target first", "draft first"])
def test_greedy_equals_the_target_alone_at_degree_two_across_the_workers(models, tp_target, prompt_ids, pipeline,
                                                                         schedule):
    from coordinator.in_memory import InMemoryPair
    from draft_worker.drafter import Drafter
    from target_worker.verifier import Verifier

    limits = Limits(tokens=tp_target.token_limit, positions=512)
    pair = InMemoryPair(tp_target, Verifier(tp_target, limits.tokens), Drafter(models["close_draft"],
                        tp_target.vocab_size, limits.tokens), limits, pipeline,
                        TARGET_FIRST if schedule == "target first" else DRAFT_FIRST, load_aware="off",
                        idle_prefill="always")
    asked = requests(prompt_ids, [POLICIES["svip"], TREE_POLICIES["svip-cape"]])
    alone = SpeculativeEngine(tp_target, None)
    assert [r.token_ids for r in pair.generate_all(asked)] == [alone.generate(r).token_ids for r in asked]


def test_sampled_output_follows_the_target_at_degree_two(models, tp_target, prompt_ids):
    """The first token of 1,200 seeded requests with speculation on: the target's own distribution
    at degree 2 (its first row's softmax at T 1)."""
    prompt = prompt_ids["medium"]
    engine = SpeculativeEngine(tp_target, models["close_draft"], load_aware="off")
    asked = [GenerationRequest(prompt, 2, SamplingParams(temperature=1.0, seed=s),
                               PolicyConfig(name="constant", draft_length=3)) for s in range(1200)]
    firsts = [r.token_ids[0] for r in engine.generate_many(asked, 32)]
    pool = KVPool(tp_target.model, 512)
    logits = pool.sequence().forward(list(prompt), 1)[0].float().clone()
    pool.close()
    logits[tp_target.token_limit:] = float("-inf")
    assert chi_square_pvalue(firsts, torch.softmax(logits.double(), dim=-1)) > ALPHA
    draft_pool = KVPool(models["close_draft"].model, 512)  # and not the draft's: the test tells them apart
    q = draft_pool.sequence().forward(list(prompt), 1)[0].double().clone()
    q[tp_target.token_limit:] = float("-inf")
    assert chi_square_pvalue(firsts, torch.softmax(q, dim=-1)) < ALPHA


@pytest.mark.parametrize("degree, words", [(3, "does not divide the model's 4 attention heads"),
                                           (4, "does not divide the model's 2 KV heads"),
                                           (9, "must be an integer in [1, 8]")])
def test_a_degree_the_model_does_not_take_is_refused_at_load(model_dirs, degree, words):
    from svip_common.tensor_parallel import load_shard

    with pytest.raises(InvalidRequest, match=words.replace("[", r"\[").replace("]", r"\]")):
        load_shard(model_dirs.target, _FakeGroup(degree))


class _FakeGroup:
    """A group's size alone: load_shard refuses a degree before it reads a weight or joins anyone."""

    def __init__(self, world: int):
        self.rank, self.world = 0, world


def test_a_feature_head_drafts_from_the_sharded_targets_features(models, model_dirs, tp_target, prompt_ids,
                                                                 tmp_path):
    """The head reads the target's fused hidden states, whole on every rank (the residual stream
    is summed over the ranks), and its own copy of the target's embedding (a shard holds half)."""
    from draft_worker.feature_draft import load_head_beside
    from draft_worker.feature_head import save_head
    from tests.integration.test_feature_draft import random_head

    path = save_head(random_head(models["target"], seed=7), tmp_path / "head")
    head = load_head_beside(str(path), model_dirs.target)
    asked = requests(prompt_ids, [POLICIES["svip"], TREE_POLICIES["svip-deep"]])
    engine = SpeculativeEngine(tp_target, head, load_aware="off")
    results = [engine.generate(r) for r in asked]
    alone = SpeculativeEngine(tp_target, None)
    assert [r.token_ids for r in results] == [alone.generate(r).token_ids for r in asked]
    assert sum(r.stats.draft_tokens for r in results) > 0
    whole = SpeculativeEngine(models["target"], head, load_aware="off")  # the head drafts alike beside the whole model
    assert [r.stats.accepted_lengths for r in results] == [whole.generate(r).stats.accepted_lengths for r in asked]


def test_the_group_listens_on_loopback_alone(tp_target):
    """The rendezvous store and gloo's pairs on 127.0.0.1, not on every address (TCPStore's server
    would take them all, gloo the machine's name's) (DESIGN.md, Placement)."""
    from tests.loopback import assert_loopback_listeners

    assert_loopback_listeners()


def test_the_step_bench_times_each_degree_beside_the_planner(model_dirs, capsys):
    from svip_bench import tp_step

    assert tp_step.main(["--target", model_dirs.target, "--degrees", "1,2", "--batches", "1", "--context", "32",
                         "--repeats", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert [row.split("|")[1:4] for row in rows] == [[" 1 ", " 1 ", " decode "], [" 1 ", " 1 ", " verify "],
                                                      [" 2 ", " 1 ", " decode "], [" 2 ", " 1 ", " verify "]]
    assert all(float(row.split("|")[4]) > 0 and float(row.split("|")[5]) > 0 for row in rows)


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_tensor_parallel_draft_keeps_every_mode_exact(models, tp_target, tp_draft, prompt_ids, pipeline):
    """The draft at degree 2 too (--draft-tp): greedy output is the target alone's in process,
    batched and through the workers' protocol, where an async session drafts side by side on
    forked pages of the sharded draft's pool; the draft's logits are the whole draft's."""
    from coordinator.in_memory import InMemoryPair
    from draft_worker.drafter import Drafter
    from target_worker.verifier import Verifier

    asked = requests(prompt_ids, [POLICIES["svip"], TREE_POLICIES["svip-cape"]])
    expected = [SpeculativeEngine(tp_target, None).generate(r).token_ids for r in asked]
    engine = SpeculativeEngine(tp_target, tp_draft, load_aware="off")
    results = [engine.generate(r) for r in asked]
    assert [r.token_ids for r in results] == expected and sum(r.stats.accepted_tokens for r in results) > 0
    assert [r.token_ids for r in engine.generate_many(asked, len(asked))] == expected
    limits = Limits(tokens=tp_target.token_limit, positions=512)
    pair = InMemoryPair(tp_target, Verifier(tp_target, limits.tokens), Drafter(tp_draft, tp_target.vocab_size,
                        limits.tokens), limits, pipeline, DRAFT_FIRST, load_aware="off")
    assert [r.token_ids for r in pair.generate_all(asked)] == expected
    whole, shard = KVPool(models["close_draft"].model, 512), KVPool(tp_draft.model, 512)
    ids = list(prompt_ids["medium"])
    expected, got = whole.sequence().forward(ids, len(ids)), shard.sequence().forward(ids, len(ids))
    assert (expected - got).abs().max() <= float32_tolerance(tp_draft.model.config, expected.flatten().tolist())
    shard.close()


def test_a_draft_degree_is_refused_for_a_feature_head_and_for_no_draft(model_dirs):
    from coordinator.front import load_inprocess
    from svip_assets import default_head
    from svip_common.pair_config import PairConfig

    with pytest.raises(InvalidRequest, match="draft_tp needs a draft model"):
        PairConfig(model_dirs.target, None, draft_tp=2).checked()
    with pytest.raises(InvalidRequest, match="a tensor-parallel draft takes one GPU a rank"):
        PairConfig(model_dirs.target, model_dirs.close_draft, draft_tp=2, draft_gpus=2).checked()
    with pytest.raises(InvalidRequest, match="draft_tp 2: a feature head runs on one device"):
        load_inprocess(PairConfig(model_dirs.target, default_head(), draft_tp=2))
