"""The feature draft in process (draft_worker/feature_draft.py): greedy output equals the target
alone for every length policy, one request at a time and batched, with heads over the target's
whole vocabulary and over a part of it, on a target with padding ids; sampled output follows the
target's distribution; the head's cache, carried across rounds, drafts what a fresh one would.

The random heads here agree with their target on little, so nearly every block ends in a
rejection; the embedded pair's trained head (svip_assets/head) is where blocks are accepted in
full and in part, and those paths are checked there."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from coordinator.engine import SpeculativeEngine
from draft_worker.feature_draft import FeatureDrafter, load_feature_draft
from draft_worker.feature_head import FeatureHead, HeadCache, HeadConfig, save_head
from svip_common.contracts import Block, GenerationRequest, PolicyConfig, SamplingParams
from svip_common.models import is_feature_head, load_model
from target_worker.verifier import Verifier
from tests.integration.test_sampling_exact import SAMPLES, assert_first_tokens_follow_the_target

POLICIES = {
    "svip": PolicyConfig(name="svip", threshold=0.9),
    "svip-default": PolicyConfig(name="svip"),
    "constant": PolicyConfig(name="constant", draft_length=4),
    "heuristic": PolicyConfig(name="heuristic", draft_length=3),
    "confidence": PolicyConfig(name="confidence", confidence=0.05),
    "auto": PolicyConfig(name="auto"),
    "none": PolicyConfig(name="none"),
}
MAX_NEW = 40


def random_head(target, seed: int, sharpness: float = 4.0, reduced: bool = False) -> FeatureHead:
    """A random head for ``target``; sharpness scales its LM head (lower entropy, longer SVIP
    blocks); reduced: its vocabulary is every other target id (d2t maps it, as EAGLE-3's does)."""
    config = HeadConfig.for_target(target.model.config)
    vocab = config.vocab_size
    if reduced:
        config = dataclasses.replace(config, draft_vocab_size=(vocab + 1) // 2)
    torch.manual_seed(seed)
    head = FeatureHead(config)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
        head.lm_head.weight.mul_(sharpness)
        if reduced:
            draft_ids = torch.arange(config.draft_vocab_size)
            head.d2t.copy_(draft_ids)  # draft id i -> target id 2i
            head.t2d.copy_(torch.arange(vocab) % 2 == 0)
    return head.eval()


@pytest.fixture(scope="module")
def heads(models, tmp_path_factory):
    """Heads saved in the published layout and loaded back as the engine loads them."""
    root = tmp_path_factory.mktemp("heads")
    out = {}
    for name, reduced, sharpness in (("full", False, 4.0), ("reduced", True, 4.0), ("flat", False, 0.05)):
        path = save_head(random_head(models["target"], seed=7, sharpness=sharpness, reduced=reduced), root / name)
        out[name] = load_feature_draft(str(path), models["target"])
    return out


@pytest.fixture(scope="module")
def reference(models, prompt_ids):
    """The target alone, through Hugging Face's own greedy generate."""
    out = {}
    for name, ids in prompt_ids.items():
        with torch.inference_mode():
            full = models["target"].model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                                   eos_token_id=None)
        out[name] = full[0, len(ids):].tolist()
    return out


@pytest.mark.parametrize("head", ["full", "reduced"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_greedy_equals_target_alone(models, heads, prompt_ids, reference, head, policy):
    engine = SpeculativeEngine(models["target"], heads[head], load_aware="off")
    assert engine.feature_draft and isinstance(engine.drafter, FeatureDrafter)
    drafted = 0
    for name, ids in prompt_ids.items():
        result = engine.generate(GenerationRequest(ids, MAX_NEW, policy=POLICIES[policy]))
        assert result.token_ids == reference[name], (policy, head, name)
        assert result.stats.target_forwards == result.stats.rounds
        if policy != "none":
            assert result.stats.draft_lengths[0] == 0  # the first round brings the prompt's features
        drafted += result.stats.draft_tokens
    assert (drafted > 0) == (policy != "none")


@pytest.mark.parametrize("head", ["full", "reduced"])
def test_batched_equals_one_at_a_time(models, heads, prompt_ids, head, monkeypatch):
    """Greedy and sampled sessions (each its own seed and warp) in one batch, through several
    policies, equal the same requests one at a time, token for token and block for block; the
    batch's drafted tokens went through the head's layer together."""
    engine = SpeculativeEngine(models["target"], heads[head], load_aware="off")
    widths = []
    decode_rows = type(heads[head].head).decode_rows
    monkeypatch.setattr(type(heads[head].head), "decode_rows",
                        lambda self, e, f, caches: widths.append(len(caches)) or decode_rows(self, e, f, caches))
    requests = []
    for i, (policy, ids) in enumerate(zip(["svip", "constant", "heuristic", "confidence"] * 3,
                                          list(prompt_ids.values()) * 4)):
        sampling = SamplingParams() if i % 2 else SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i)
        requests.append(GenerationRequest(ids, 24, sampling=sampling, policy=POLICIES[policy]))
    batched = engine.generate_many(requests, 5)
    assert widths and max(widths) > 1
    widths.clear()
    for request, result in zip(requests, batched):
        alone = engine.generate(request)
        assert result.token_ids == alone.token_ids
        assert result.stats.draft_lengths == alone.stats.draft_lengths
    assert not widths  # one at a time: the per-session path


def test_padding_ids_of_a_wide_target_are_never_drafted(wide_pair):
    """A target whose logits run past its tokenizer: a head over its whole width never drafts those
    ids (the padding columns are masked before the choice) and greedy output is the target's."""
    target = load_model(wide_pair.target)
    head = random_head(target, seed=3, sharpness=8.0)
    with torch.no_grad():
        head.lm_head.weight[wide_pair.tokens:] *= 100.0  # the padding rows would win if not masked
    engine = SpeculativeEngine(target, _as_loaded(head, target), load_aware="off")
    alone = SpeculativeEngine(target, None)
    ids = list(target.tokenizer("The quick brown fox")["input_ids"])
    seen = []
    result = engine.generate(GenerationRequest(ids, 24, policy=POLICIES["constant"]),
                             on_round=lambda block, verdict, settled: seen.extend(block.tokens))
    assert seen and max(seen) < wide_pair.tokens
    assert result.token_ids == alone.generate(GenerationRequest(ids, 24)).token_ids


def _as_loaded(head, target):
    from draft_worker.feature_draft import LoadedHead

    return LoadedHead("memory", head.to(target.model.dtype))


@torch.inference_mode()
def test_a_session_carried_across_rounds_drafts_what_a_fresh_one_would(models, heads, prompt_ids):
    """After rounds of rejections, the head's cache (its target pairs kept, its own dropped) gives
    the block a fresh session gives from the same committed sequence and the same features."""
    target, head = models["target"], heads["full"]
    layers = head.head.config.target_layers
    engine = SpeculativeEngine(target, head, load_aware="off")
    policy = POLICIES["constant"]
    session = engine.open(GenerationRequest(prompt_ids["long"], MAX_NEW, policy=policy))
    for _ in range(6):  # rounds: empty first, then blocks and verdicts
        block = session.propose()
        session.settle(block, session.target.verify(session.committed, block))
    carried = session.propose()
    fresh_verifier = Verifier(target, kv_cache_tokens=4096, feature_layers=layers)
    fresh_target = fresh_verifier.open(SamplingParams())
    fresh = engine.drafter.open(SamplingParams(), policy, ())
    committed = session.committed[:-1]  # the target runs over all but the last; its verdict adds it
    verdict = fresh_target.verify(committed, Block(base=len(committed), tokens=[], probs=[], entropies=[]))
    assert verdict.token == session.committed[-1]
    fresh.take_features(verdict.features, verdict.features_from)
    again = fresh.propose(session.committed, MAX_NEW)
    assert again.tokens == carried.tokens
    assert again.probs == pytest.approx(carried.probs, rel=1e-4, abs=1e-6)
    session.close()


def test_threshold_auto_is_calibrated_on_the_heads_own_blocks(models, heads, prompt_ids, reference):
    """`--threshold auto` with a head: the threshold comes from blocks the head drafts on its own
    outputs at every place of the target's continuation (not a teacher-forced slice), and SVIP at
    it stays exact."""
    from coordinator.calibration import THRESHOLD_GRID
    from coordinator.head_calibration import CHAIN_DEPTH, record_chains

    engine = SpeculativeEngine(models["target"], heads["full"], load_aware="off")
    request = GenerationRequest(prompt_ids["short"], MAX_NEW, policy=PolicyConfig(name="svip", threshold="auto"))
    assert engine.generate(request).token_ids == reference["short"]
    calibration = engine.calibration()
    assert calibration.threshold in THRESHOLD_GRID and calibration.tokens > 0 and calibration.cost_ratio > 0
    target, head = models["target"], heads["full"].head
    chains = record_chains(target, head, list(prompt_ids["short"]), 12)
    assert len(chains) == 12 and all(0 < len(m) <= CHAIN_DEPTH for m in chains.matches)
    assert [len(m) for m in chains.matches[-3:]] == [3, 2, 1]  # a block drafts no further than the target went
    # each block's first token reads the target's features: the head's teacher-forced guess there
    prompt = list(prompt_ids["short"])
    sequence = torch.tensor([prompt + reference["short"][:12]])
    with torch.inference_mode():
        hidden = target.model(input_ids=sequence, output_hidden_states=True).hidden_states
        embeds = target.model.get_input_embeddings()(sequence[0, 1:])
        outputs = head(embeds, head.fuse(tuple(h[0, :-1] for h in hidden)), HeadCache())
        guesses = head.target_ids(head.logits(outputs).argmax(-1))  # at position j: the token at j + 2
    first = [bool(guesses[len(prompt) + i - 2] == sequence[0, len(prompt) + i]) for i in range(12)]
    assert [m[0] for m in chains.matches] == first


def test_a_head_directory_is_told_from_a_model_directory(models, heads, model_dirs):
    assert is_feature_head(heads["full"].path)
    assert not is_feature_head(model_dirs.target)
    assert not is_feature_head(None)


@pytest.mark.slow
def test_sampled_tokens_follow_the_target(models, heads, prompt_ids):
    """The first two tokens' marginals fit the target's: the first from the target alone (the
    round that brings the prompt's features), the second through the head's block (its draws
    rejected and corrected often, accepted often too: a random head, nearly uniform)."""
    sampling = SamplingParams(temperature=1.0)
    prompt = prompt_ids["medium"]
    engine = SpeculativeEngine(models["target"], heads["flat"], load_aware="off")
    requests = [GenerationRequest(prompt, 3, sampling=SamplingParams(temperature=1.0, seed=seed), ignore_eos=True,
                                  policy=PolicyConfig(name="constant", draft_length=2)) for seed in range(SAMPLES)]
    results = engine.generate_many(requests, 50)
    second = [r for r in results if len(r.stats.draft_lengths) > 1]
    assert len(second) == SAMPLES  # every request drafted its second token
    assert sum(r.stats.accepted_lengths[1] < r.stats.draft_lengths[1] for r in second) > SAMPLES // 10
    assert sum(r.stats.accepted_lengths[1] > 0 for r in second) > SAMPLES // 50
    assert_first_tokens_follow_the_target(models, prompt, sampling, results)


def test_the_cli_drafts_with_a_head_directory(models, heads, model_dirs, prompt_ids, capsys):
    """`svip generate --draft HEAD_DIR` loads the head (told from a model by its config) and prints
    what the target alone prints, at a threshold given or calibrated for the head; 'eagle' beside
    another target is refused in one line."""
    import json

    from svip_cli.main import main

    ids = ",".join(map(str, prompt_ids["medium"]))
    common = ["generate", "--target", model_dirs.target, "--prompt-ids", ids, "--max-new-tokens", "12", "--json"]
    assert main([*common, "--draft", heads["full"].path, "--policy", "svip"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert main([*common, "--draft", "none"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert drafted["token_ids"] == alone["token_ids"]
    assert drafted["stats"]["config"]["draft"] == heads["full"].path
    assert drafted["stats"]["draft_tokens"] > 0
    assert main([*common, "--draft", "eagle"]) == 2
    assert "draft 'eagle' is the embedded target's feature head" in capsys.readouterr().err
    assert main([*common, "--draft", heads["full"].path, "--policy", "svip", "--threshold", "auto"]) == 0
    calibrated = json.loads(capsys.readouterr().out)
    assert calibrated["token_ids"] == alone["token_ids"]
    assert calibrated["stats"]["config"]["threshold_auto"]["tokens"] > 0  # calibrated on the head's own blocks


def _ready(models, head, k: int, committed):
    """A feature draft session (constant k, no stop ids) holding the target's features for
    ``committed``, as after a verdict that committed it."""
    drafter = SpeculativeEngine(models["target"], head, load_aware="off").drafter
    session = drafter.open(SamplingParams(), PolicyConfig(name="constant", draft_length=k), ())
    session.take_features(verdict_features(models, head, committed), 0)
    return drafter, session


@torch.inference_mode()
def test_blocks_drafted_ahead_of_their_verdict_continue_from_the_heads_own_outputs(models, heads, prompt_ids):
    """The distributed pipeline drafts before the target's features arrive: a follow-up (the block
    assumed accepted) continues exactly as a longer block would; a prepared continuation (an
    alternative token in the block) reads the head's output before it; the main line drafted
    again after that rebuilds the outputs it dropped, one pair at a time, to the same tokens."""
    committed = list(prompt_ids["long"])
    _, longer = _ready(models, heads["full"], 6, committed)
    reference = longer.propose(committed, 6)
    drafter, session = _ready(models, heads["full"], 3, committed)
    first = session.propose(committed, 3)
    follow = session.propose(committed + first.tokens, 3)
    assert first.tokens + follow.tokens == reference.tokens
    assert first.probs + follow.probs == reference.probs  # bitwise: the same pairs, the same shapes

    alternative = next(t for t in range(5, 300) if t != first.tokens[1])
    prepared = session.propose(committed + first.tokens[:1] + [alternative], 1)
    head, embed = drafter.head, drafter.embedding
    features = verdict_features(models, heads["full"], committed)
    out = head(embed(torch.tensor(committed[1:])), head.fc(features), cache := HeadCache())
    out = head(embed(torch.tensor([first.tokens[0]])), out[-1:], cache)
    out = head(embed(torch.tensor([alternative])), out[-1:], cache)
    q = torch.softmax(drafter._widen(head.logits(out[-1:])), dim=-1)[0]
    assert prepared.tokens == [int(q.argmax())]
    assert prepared.probs[0] == pytest.approx(float(q.max()), rel=1e-5)

    again = session.propose(committed + first.tokens, 3)
    assert again.tokens == follow.tokens
    assert again.probs == pytest.approx(follow.probs, rel=1e-5)


def verdict_features(models, head, committed):
    """The target's features at positions 0 .. len(committed) - 2, as a verdict that committed
    ``committed`` hands them over."""
    verifier = Verifier(models["target"], kv_cache_tokens=4096, feature_layers=head.head.config.target_layers)
    before = list(committed[:-1])
    return verifier.open(SamplingParams()).verify(before, Block(base=len(before), tokens=[], probs=[],
                                                                 entropies=[])).features


def test_a_head_beside_a_sharded_target_reads_only_its_embedding(models, heads, model_dirs, tmp_path):
    """The draft worker's loader: the target's config and, from a sharded checkpoint, the one
    shard holding embed_tokens.weight; the same table as the model's own. A target with no
    safetensors checkpoint is a one-line error."""
    import json
    import shutil

    from safetensors.torch import save_file

    from draft_worker.feature_draft import load_head_beside
    from svip_common.errors import ModelLoadError

    target = models["target"]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(f"{model_dirs.target}/config.json", sharded / "config.json")
    state = {k: v.contiguous() for k, v in target.model.state_dict().items()}
    embed = "model.embed_tokens.weight"
    save_file({embed: state[embed]}, str(sharded / "shard-1.safetensors"))
    save_file({k: v for k, v in state.items() if k != embed}, str(sharded / "shard-2.safetensors"))
    weight_map = {k: ("shard-1.safetensors" if k == embed else "shard-2.safetensors") for k in state}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_head_beside(heads["full"].path, str(sharded))
    assert torch.equal(loaded.embedding.weight, target.model.get_input_embeddings().weight)
    assert loaded.head.config == heads["full"].head.config
    (sharded / "model.safetensors.index.json").unlink()
    with pytest.raises(ModelLoadError, match="no safetensors checkpoint"):
        load_head_beside(heads["full"].path, str(sharded))


@torch.inference_mode()
def test_after_features_that_never_came_the_head_starts_afresh(models, heads, prompt_ids):
    """Positions whose features the draft never got (tokens the target settled alone during a
    pause): the head drafts again from the first feature it has, exactly as a session that never
    had the earlier ones, never from a wrong context and never stuck on an empty block."""
    committed = list(prompt_ids["long"])
    more = committed + [5, 17, 42, 8, 99, 23]
    features = verdict_features(models, heads["full"], more)
    _, carried = _ready(models, heads["full"], 3, committed)
    carried.propose(committed, 3)
    gap = len(committed) + 2  # positions len(committed) - 1 .. gap - 1 never arrive
    carried.take_features(features[gap:], gap)
    again = carried.propose(more, 3)
    assert carried._drafter.fresh_starts == 1
    drafter = SpeculativeEngine(models["target"], heads["full"], load_aware="off").drafter
    fresh = drafter.open(SamplingParams(), PolicyConfig(name="constant", draft_length=3), ())
    fresh.take_features(features[gap:], gap)
    reference = fresh.propose(more, 3)
    assert len(again) == 3 and again.tokens == reference.tokens and again.probs == reference.probs


def test_the_embedded_head_starts_auto_from_its_stored_prior():
    """`--draft eagle` with policy auto: the estimate starts from the prior stored beside the head
    (training/head_card.py fits it on the head's own blocks), not the generic one."""
    import json
    from pathlib import Path

    from svip_assets import default_head, default_pair

    target = load_model(default_pair()[0])
    engine = SpeculativeEngine(target, load_feature_draft(default_head(), target), load_aware="off")
    stored = json.loads((Path(default_head()) / "svip_auto_prior.json").read_text())
    estimate = engine.auto_estimate()
    assert estimate.prior_cost == pytest.approx(stored["cost"])
    assert stored["weights"][-1] < 0  # the head's later places are accepted less: the fit says so


@pytest.mark.parametrize("head", ["full", "reduced"])
@pytest.mark.parametrize("tree", ["cape", "auto", "deep"])
def test_a_heads_token_tree_equals_target_alone(models, heads, prompt_ids, reference, head, tree):
    """A feature head drafts token trees (issue 44): its runners-up at each place are the
    siblings; deep trees give the last place's a child each (the rest stay leaves); greedy output
    is the target's own, one request at a time and batched."""
    engine = SpeculativeEngine(models["target"], heads[head], load_aware="off")
    # a constant block's last place is its cap, which no child may pass: deep grows below SVIP's
    policy = PolicyConfig(name="svip", threshold=0.3, tree=tree) if tree == "deep" else \
        PolicyConfig(name="constant", draft_length=3, tree=tree)
    requests = [GenerationRequest(ids, MAX_NEW, policy=policy) for ids in prompt_ids.values()]
    grown = []
    results = [engine.generate(r, on_round=lambda block, verdict, settled: grown.append(len(block.grown or ())))
               for r in requests]
    assert [r.token_ids for r in results] == [reference[name] for name in prompt_ids]
    assert [r.token_ids for r in engine.generate_many(requests, len(requests))] == [r.token_ids for r in results]
    assert sum(r.stats.tree_nodes for r in results) > sum(r.stats.draft_tokens for r in results)
    assert (sum(grown) > 0) == (tree == "deep")


def test_a_heads_seeded_sampled_deep_tree_reproduces_one_at_a_time_and_batched(models, heads, prompt_ids):
    """Sampled deep trees with a head: every draw keyed by (seed, place, purpose), the grown
    children's coins too, so a request draws the same tokens alone, again, and in a batch;
    children were grown. (The walk that judges them is the draft model's: its chi-square,
    tests/integration/test_sampling_exact.py, is drafter-agnostic.)"""
    engine = SpeculativeEngine(models["target"], heads["full"], load_aware="off")
    policy = PolicyConfig(name="svip", threshold=0.3, tree="deep")
    requests = [GenerationRequest(ids, 24, SamplingParams(temperature=0.9, seed=7 + i), policy)
                for i, ids in enumerate(prompt_ids.values())]
    grown = []
    one = [engine.generate(r, on_round=lambda block, verdict, settled: grown.append(len(block.grown or ())))
           for r in requests]
    assert sum(grown) > 0
    assert [r.token_ids for r in one] == [engine.generate(r).token_ids for r in requests]
    assert [r.token_ids for r in one] == [r.token_ids for r in engine.generate_many(requests, len(requests))]


def test_the_embedded_heads_deep_trees_settle_children_and_stay_exact(prompt_ids):
    """The embedded pair's trained head, tree deep: its last places' siblings get children
    (each the head's own choice after its sibling: tests/unit/test_feature_head.py, beside),
    rounds take them (a sibling and its child settled past a rejection), and greedy output is
    the target alone's."""
    from svip_assets import default_head, default_pair

    target = load_model(default_pair()[0])
    engine = SpeculativeEngine(target, load_feature_draft(default_head(), target), load_aware="off")
    alone = SpeculativeEngine(target, None)
    policy = PolicyConfig(name="svip", threshold=0.3, tree="deep")
    taken, grown = 0, []
    for ids in prompt_ids.values():
        result = engine.generate(GenerationRequest(ids, MAX_NEW, policy=policy),
                                 on_round=lambda block, verdict, settled: grown.append(len(block.grown or ())))
        assert result.token_ids == alone.generate(GenerationRequest(ids, MAX_NEW)).token_ids
        taken += result.stats.branch_tokens - result.stats.branches
    assert sum(grown) > 0 and taken > 0
