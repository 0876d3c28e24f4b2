"""The feature draft across workers: the target hands its features over with each feedback, the
draft worker drafts from them (and, in async mode, ahead of them from the head's own outputs).
Greedy output equals the target alone in sync and async mode for every policy, through the
in-memory transport (coordinator/in_memory.py: the real session host and draft service, every
message serialised through the wire contract, FeatureChunks included) with the embedded pair's
trained head, so blocks are accepted in full, in part and not at all; features the head cannot
read give the draft up, never the session; and the real Ray actors load a head beside the target's
checkpoint and run both pipelines over gRPC (the system tier)."""

from __future__ import annotations

import pytest
import torch

from coordinator.distributed import DistributedEngine
from coordinator.engine import SpeculativeEngine
from coordinator.in_memory import InMemoryPair
from draft_worker.feature_draft import FeatureDrafter, load_feature_draft
from svip_assets import default_head, default_pair
from svip_common.contracts import GenerationRequest, PolicyConfig
from svip_common.errors import InvalidRequest
from svip_common.kv_sizes import DEFAULT_KV_TOKENS
from svip_common.models import load_model
from svip_common.pair_config import PairConfig
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from target_worker.verifier import Verifier
from tests.integration.test_feature_draft import _as_loaded, random_head

POLICIES = {
    "svip": PolicyConfig(name="svip", threshold=0.4),
    "constant": PolicyConfig(name="constant", draft_length=4),
    "heuristic": PolicyConfig(name="heuristic", draft_length=3),
    "confidence": PolicyConfig(name="confidence", confidence=0.3),
    "auto": PolicyConfig(name="auto"),
}
TREE_POLICIES = {"svip-cape": PolicyConfig(name="svip", threshold=0.4, tree="cape"),
                 "constant-auto": PolicyConfig(name="constant", draft_length=4, tree="auto"),
                 "svip-deep": PolicyConfig(name="svip", threshold=0.3, tree="deep")}
PROMPTS = ("def parse_args(argv):\n", "class Stack:\n    def __init__(self):\n", "import os\n\nfor root, dirs")
MAX_NEW = 40


@pytest.fixture(scope="module")
def embedded():
    target = load_model(default_pair()[0])
    return target, load_feature_draft(default_head(), target)


@pytest.fixture(scope="module")
def alone_tokens(embedded):
    """The target alone's tokens for a request, each computed once for the module."""
    engine, done = SpeculativeEngine(embedded[0], None), {}

    def tokens(request: GenerationRequest) -> list[int]:
        key = (request.prompt_ids, request.max_new_tokens)
        if key not in done:
            done[key] = engine.generate(request).token_ids
        return done[key]

    return tokens


def drafter_for(target, head, limits) -> FeatureDrafter:
    return FeatureDrafter(head, target.model.get_input_embeddings(), target.vocab_size, limits.tokens)


def pair_for(target, head, mode: str, feature_layers=None, target_kv_tokens: int = DEFAULT_KV_TOKENS,
             load_aware: str = "off", idle_prefill: str = "auto") -> InMemoryPair:
    """The target behind a session host handing over ``feature_layers`` (the head's own by
    default), the head behind a draft service, joined in memory."""
    limits = _limits(target)
    layers = head.head.config.target_layers if feature_layers is None else feature_layers
    verifier = Verifier(target, limits.tokens, target_kv_tokens, layers)
    return InMemoryPair(target, verifier, drafter_for(target, head, limits), limits, mode, load_aware=load_aware,
                        idle_prefill=idle_prefill)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_greedy_equals_target_alone_across_workers(embedded, alone_tokens, mode):
    """Every policy, chains and the head's token trees (their siblings the head's runners-up; a
    sibling taken hands the head the target's feature there; deep: the last place's siblings'
    children cross the wire, and rounds take them)."""
    target, head = embedded
    ids = [tuple(target.tokenizer(p)["input_ids"]) for p in PROMPTS]
    requests = [GenerationRequest(i, MAX_NEW, policy=policy, ignore_eos=True)
                for policy in [*POLICIES.values(), *TREE_POLICIES.values()] for i in ids]
    results = pair_for(target, head, mode).generate_all(requests)
    for request, result in zip(requests, results):
        assert result.token_ids == alone_tokens(request), (mode, request.policy.name)
        assert result.stats.detached == 0
    assert sum(r.stats.branches for r in results) > 0  # siblings settled rejected places
    deep = [r for request, r in zip(requests, results) if request.policy.tree == "deep"]
    assert sum(r.stats.branch_tokens - r.stats.branches for r in deep) > 0  # grown children taken
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert 0 < accepted < drafted  # rejections and acceptances both
    assert any(a == d > 0 for r in results for a, d in zip(r.stats.accepted_lengths, r.stats.draft_lengths))
    assert all(r.stats.wire_bytes > 0 for r in results)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_features_sent_ahead_in_chunks_draft_what_one_piece_drafts(embedded, alone_tokens, monkeypatch, mode):
    """With chunks of two rows (the embedded head's rows are 3 KB), every prompt's features and
    most verdicts' go ahead in FeatureChunks, joined by the draft worker: output equal to the
    target alone, nothing detached, and as many tokens drafted and accepted as in one piece."""
    target, head = embedded
    row = len(head.head.config.target_layers) * head.head.config.hidden_size * 4
    ids = [tuple(target.tokenizer(p)["input_ids"]) for p in PROMPTS]
    requests = [GenerationRequest(i, MAX_NEW, policy=POLICIES["svip"], ignore_eos=True) for i in ids]

    def run():  # the target's idle work at every idle moment: the same in both runs (auto's reads the clock)
        pair = pair_for(target, head, mode, idle_prefill="always")
        added = []
        real_add = pair.draft._chunks.add
        pair.draft._chunks.add = lambda sid, first, f: (added.append(f.shape[0]), real_add(sid, first, f))
        return pair.generate_all(requests), added

    whole, none_added = run()
    monkeypatch.setattr(convert, "FEATURE_CHUNK_BYTES", 2 * row)
    chunked, added = run()
    assert not none_added and len(added) >= len(requests) and set(added) == {2}
    assert [r.token_ids for r in chunked] == [alone_tokens(r) for r in requests]
    assert all(r.stats.detached == 0 for r in chunked)
    if mode == "sync":  # the same blocks: the chunks change how the features travel, not what they are
        assert [r.stats.draft_lengths for r in chunked] == [r.stats.draft_lengths for r in whole]


def test_a_preempted_session_hands_the_head_no_feature_twice(embedded):
    """Four sessions of about six pages each start together on a pool of 16 (every start is
    delivered before the target's first step, so pages run short by construction) and the newest
    is preempted, with a feature head drafting: its cache and features are recomputed on its
    return (those the head already holds are not sent again), nothing detaches, and every output
    equals the target alone."""
    target, head = embedded
    ids = [tuple(target.tokenizer(p)["input_ids"]) for p in PROMPTS]
    requests = [GenerationRequest(ids[i % 3] + (i,), 80, policy=POLICIES["constant"], ignore_eos=True)
                for i in range(4)]
    pair = pair_for(target, head, "async", target_kv_tokens=256)
    results = pair.generate_all(requests)
    preemptions = pair.host.pages.preemptions
    alone = SpeculativeEngine(target, None)
    assert preemptions >= 1
    assert [r.token_ids for r in results] == [alone.generate(r).token_ids for r in requests]
    assert all(r.stats.detached == 0 and r.stats.draft_tokens > 0 for r in results)


def _limits(target):
    from svip_common.contracts import Limits

    return Limits(tokens=target.token_limit, positions=target.max_positions or 512)


def test_features_the_head_cannot_read_give_the_draft_up_not_the_session(models, prompt_ids):
    """The target hands over two layers where the head fuses three: the draft refuses the first
    feedback that carries them, the session goes on with the target alone, exact."""
    target = models["target"]
    head = _as_loaded(random_head(target, seed=7), target)
    requests = [GenerationRequest(ids, 24, policy=POLICIES["constant"], ignore_eos=True) for ids in prompt_ids.values()]
    results = pair_for(target, head, "async", feature_layers=(0, 1)).generate_all(requests)
    alone = SpeculativeEngine(target, None)
    assert [r.token_ids for r in results] == [alone.generate(r).token_ids for r in requests]
    assert all(r.stats.detached == 1 and r.stats.draft_tokens == 0 for r in results)


@pytest.mark.parametrize("change, message", [
    (lambda f: f.double(), "dtype float64"),
    (lambda f: f[:, :-1], "shape"),
    (lambda f: f[:-1], "positions"),
])
def test_a_feedback_with_bad_features_is_invalid_argument(models, loop, change, message):
    """The draft service's check, message by message: the head's dtype, its width, and exactly the
    positions the verdict commits."""
    from draft_worker.service import DraftService

    target = models["target"]
    head = _as_loaded(random_head(target, seed=7), target)
    service = DraftService(drafter_for(target, head, _limits(target)), _limits(target))
    width = 3 * target.model.config.hidden_size
    good = torch.zeros(6, width)
    msg = convert.feedback_from_proto(pb.Feedback(session_id="s", base=4, drafted=3, accepted=2, token=5,
                                                  features_from=0, features=convert.tensor_to_proto(good)),
                                      service.drafter.width)
    assert service._features(msg, msg.base + msg.accepted)[0].shape == (6, width)
    bad = convert.feedback_from_proto(pb.Feedback(session_id="s", base=4, drafted=3, accepted=2, token=5,
                                                  features_from=0, features=convert.tensor_to_proto(change(good))),
                                      service.drafter.width)
    with pytest.raises(InvalidRequest, match=message):
        service._features(bad, bad.base + bad.accepted)


@pytest.mark.system
def test_ray_workers_load_a_head_beside_the_targets_checkpoint(loop):
    """The real actors: the draft worker reads the target's embedding table from its safetensors
    and the head, the target worker hands its features over; sync and async equal the target alone."""
    import ray

    from coordinator.cluster import WorkerPair, init_local_ray

    target_path = default_pair()[0]
    init_local_ray()
    pair = WorkerPair(PairConfig(target_path, default_head(), load_aware="off"))
    try:
        target = load_model(target_path)
        alone = SpeculativeEngine(target, None)
        ids = tuple(target.tokenizer(PROMPTS[0])["input_ids"])
        request = GenerationRequest(ids, 32, policy=POLICIES["svip"], ignore_eos=True)
        for mode in ("sync", "async"):
            engine = DistributedEngine(pair.target_info, pair.limits, pair.target_address, pair.draft_address, mode)
            loop.run_until_complete(engine.connect())
            try:
                result = loop.run_until_complete(engine.generate(request))
            finally:
                loop.run_until_complete(engine.close())
            assert result.token_ids == alone.generate(request).token_ids
            assert result.stats.accepted_tokens > 0 and result.stats.detached == 0
    finally:
        pair.shutdown()
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("mode, tree", [pytest.param("sync", "off", marks=pytest.mark.system), ("async", "off"),
                                        pytest.param("async", "cape", marks=pytest.mark.system)])
def test_sampled_tokens_follow_the_target_across_workers(models, prompt_ids, mode, tree):
    """The head's draws across workers, each pipeline (async in README's tier, sync in the second,
    for time): the draft keeps q and draws each correction
    from the p row the target sends. The first two tokens' marginals fit the target's (the first from the target
    alone, the round that brings the prompt's features; the second through the head's block). tree
    cape: the head's blocks are token trees, their q rows on the wire; the target tries the siblings
    at a rejected place and draws the correction itself."""
    from svip_common.contracts import SamplingParams
    from tests.integration.test_sampling_exact import ALPHA, chi_square_pvalue, exact_marginals

    target = models["target"]
    head = _as_loaded(random_head(target, seed=7, sharpness=0.05), target)
    prompt = prompt_ids["medium"]
    requests = [GenerationRequest(prompt, 3, sampling=SamplingParams(temperature=1.0, seed=s), ignore_eos=True,
                                  policy=PolicyConfig(name="constant", draft_length=2, tree=tree))
                for s in range(1500)]
    pair = pair_for(target, head, mode)
    results = []
    for i in range(0, len(requests), 100):
        results += pair.generate_all(requests[i : i + 100])
    assert all(r.stats.detached == 0 for r in results)
    second = [r for r in results if len(r.stats.draft_lengths) > 1 and r.stats.draft_lengths[1]]
    assert sum(r.stats.accepted_lengths[1] == 0 for r in second) > len(results) // 10  # corrections drawn
    assert sum(r.stats.accepted_lengths[1] > 0 for r in second) > len(results) // 50  # and acceptances
    trees = sum(r.stats.tree_nodes for r in results) > sum(r.stats.draft_tokens for r in results)
    assert trees == (tree != "off")  # siblings (and q rows) crossed the wire
    p1, p2 = exact_marginals(target.model, prompt, SamplingParams(temperature=1.0))
    assert chi_square_pvalue([r.token_ids[0] for r in results], p1) > ALPHA
    assert chi_square_pvalue([r.token_ids[1] for r in results], p2) > ALPHA
    _, q2 = exact_marginals(models["close_draft"].model, prompt, SamplingParams(temperature=1.0))
    assert chi_square_pvalue([r.token_ids[1] for r in results], q2) < ALPHA


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_drafting_resumes_after_load_aware_pauses(models, prompt_ids, mode):
    """Scripted caps pause sessions (the target settles tokens alone) and resume them: the Resume
    brings the features of the tokens settled meanwhile, so the head drafts on after a pause with
    its whole context (it never starts afresh); output equals the target alone."""
    from tests.integration.test_load_aware import requests as load_requests
    from tests.integration.test_load_aware import schedule

    target = models["target"]
    head = _as_loaded(random_head(target, seed=7), target)
    caps = {}
    reqs = load_requests(prompt_ids)
    pair = pair_for(target, head, mode, load_aware="all")
    drafter = pair.draft.drafter
    pair.host.load_cap = lambda gate: next(caps.setdefault(id(gate), schedule(len(caps))))
    results = pair.generate_all(reqs)
    assert drafter.fresh_starts == 0
    alone = SpeculativeEngine(target, None)
    assert [r.token_ids for r in results] == [alone.generate(r).token_ids for r in reqs]
    resumed = [drafts_again for r in results for drafts_again in _after_pauses(r.stats)]
    assert sum(r.stats.pauses for r in results) > 0 and len(resumed) >= 3
    assert sum(resumed) >= 0.8 * len(resumed)  # before the fix: none (the head waited for features for ever)


def _after_pauses(stats) -> list[bool]:
    """For each run of paused rounds after the session's first drafted token and followed by at
    least two drafted rounds: whether one of those drafted a token."""
    rounds = list(zip(stats.round_sources, stats.draft_lengths))
    out, drafted_before = [], False
    for i, (source, length) in enumerate(rounds):
        drafted_before = drafted_before or length > 0
        if source == "paused" and drafted_before and i + 1 < len(rounds) and rounds[i + 1][0] != "paused":
            after = []
            for later_source, later_length in rounds[i + 1 :]:
                if later_source == "paused":
                    break
                after.append(later_length)
            if len(after) >= 2:
                out.append(any(after))
    return out


def test_a_resume_with_features_past_its_tokens_is_invalid_argument(models):
    """A Resume's features cover exactly the positions its tokens leave committed, but the last."""
    from draft_worker.service import DraftService

    target = models["target"]
    head = _as_loaded(random_head(target, seed=7), target)
    service = DraftService(drafter_for(target, head, _limits(target)), _limits(target))
    features = convert.tensor_to_proto(torch.zeros(4, 3 * target.model.config.hidden_size))
    msg = convert.resume_from_proto(pb.Resume(session_id="s", base=10, tokens=[5, 6, 7], load_cap=4, features_from=8,
                                              features=features))
    assert service._features(msg, msg.base + len(msg.tokens) - 1)[0].shape[0] == 4
    with pytest.raises(InvalidRequest, match="commit up to 10"):
        service._features(msg, msg.base + len(msg.tokens) - 2)
