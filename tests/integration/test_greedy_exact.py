"""Greedy speculative output equals the target decoding alone, token for token: every policy,
random / close / identical drafts, prompts of several lengths, EOS and max_new_tokens inside a
block, and blocks that run to the cap of 40."""

from __future__ import annotations

import pytest
import torch

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig

POLICIES = {
    "svip": PolicyConfig(name="svip", threshold=0.6),  # ~ varied lengths on these random models
    "svip-default": PolicyConfig(name="svip"),
    "constant": PolicyConfig(name="constant", draft_length=4),
    "heuristic": PolicyConfig(name="heuristic", draft_length=3),
    "confidence": PolicyConfig(name="confidence", confidence=0.2),
    "auto": PolicyConfig(name="auto"),
    "none": PolicyConfig(name="none"),
}
MAX_NEW = 48


@pytest.fixture(scope="module")
def reference(models, prompt_ids):
    """Target alone, through Hugging Face's own greedy generate (not our engine)."""
    model = models["target"].model
    out = {}
    for name, ids in prompt_ids.items():
        with torch.inference_mode():
            full = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None
            )
        out[name] = full[0, len(ids):].tolist()
    return out


def _generate(target, draft, ids, policy, max_new=MAX_NEW, stop=()):
    engine = SpeculativeEngine(target, draft, load_aware="off")
    request = GenerationRequest(ids, max_new, policy=policy, stop_token_ids=stop)
    return engine.generate(request)


@pytest.mark.parametrize("draft_name", ["random_draft", "close_draft", "target"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_greedy_equals_target_alone(models, prompt_ids, reference, draft_name, policy):
    for name, ids in prompt_ids.items():
        result = _generate(models["target"], models[draft_name], ids, POLICIES[policy])
        assert result.token_ids == reference[name], (policy, draft_name, name)
        assert result.finish_reason == "length"
        assert result.stats.target_forwards == result.stats.rounds


def test_target_alone_engine_matches_hf_generate(models, prompt_ids, reference):
    for name, ids in prompt_ids.items():
        assert _generate(models["target"], None, ids, POLICIES["svip"]).token_ids == reference[name]


def test_close_draft_exercises_accept_and_reject(models, prompt_ids):
    """Guards the tests above: with the close draft, blocks are partly accepted and partly not."""
    stats = _generate(models["target"], models["close_draft"], prompt_ids["medium"], POLICIES["constant"]).stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert any(0 < a < d for a, d in zip(stats.accepted_lengths, stats.draft_lengths))


def test_identical_draft_accepts_everything(models, prompt_ids):
    stats = _generate(models["target"], models["target"], prompt_ids["long"], POLICIES["constant"]).stats
    assert stats.accepted_tokens == stats.draft_tokens
    assert stats.rounds == -(-MAX_NEW // 5)  # k = 4 drafted + 1 bonus per round


@pytest.mark.parametrize("policy", ["svip", "constant", "heuristic", "confidence"])
def test_stop_token_inside_a_block(models, prompt_ids, reference, policy):
    """A stop id that the target emits mid-block ends the output right after it."""
    ref = reference["long"]
    stop_at = next(i for i in range(6, len(ref)) if ref[i] not in ref[:i])
    engine_policy = PolicyConfig(name=policy, draft_length=8, threshold=5.0, confidence=0.0)
    for draft in ("close_draft", "target"):
        result = _generate(models["target"], models[draft], prompt_ids["long"], engine_policy, stop=(ref[stop_at],))
        assert result.token_ids == ref[: stop_at + 1]
        assert result.finish_reason == "stop"
    # with draft == target every block is accepted: the stop id cut the last block short
    stats = result.stats
    assert stats.accepted_tokens + stats.rounds > len(result.token_ids)


def test_model_eos_ends_generation(model_dirs, prompt_ids, reference, tmp_path):
    """The model's own EOS (generation_config) ends generation exactly where the target alone does."""
    from svip_common.models import load_model

    ref = reference["medium"]
    eos_at = next(i for i in range(5, len(ref)) if ref[i] not in ref[:i])
    target = load_model(model_dirs.target)
    target.model.generation_config.eos_token_id = ref[eos_at]
    target.eos_token_ids = (ref[eos_at],)
    result = _generate(target, target, prompt_ids["medium"], PolicyConfig(name="constant", draft_length=7))
    assert result.token_ids == ref[: eos_at + 1] and result.finish_reason == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 7, 13])
def test_max_new_tokens_inside_a_block(models, prompt_ids, reference, max_new):
    for draft in ("target", "close_draft"):
        policy = PolicyConfig(name="constant", draft_length=8)
        result = _generate(models["target"], models[draft], prompt_ids["long"], policy, max_new=max_new)
        assert result.token_ids == reference["long"][:max_new]
        assert result.finish_reason == "length"
        assert max(result.stats.draft_lengths) <= max_new - 1


def test_svip_cap_of_40_reached(models, prompt_ids):
    """A low-entropy model drafting for itself: SVIP never stops on entropy, the cap does."""
    peaky = models["peaky"]
    ids = prompt_ids["short"]
    with torch.inference_mode():
        ref = peaky.model.generate(torch.tensor([ids]), max_new_tokens=100, do_sample=False, eos_token_id=None)
    result = _generate(peaky, peaky, ids, PolicyConfig(name="svip"), max_new=100)
    assert result.token_ids == ref[0, len(ids):].tolist()
    assert max(result.stats.draft_lengths) == 40
    assert result.stats.draft_lengths.count(40) >= 2


def test_many_requests_on_one_engine_are_independent(models, prompt_ids, reference):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    for _ in range(2):
        for name, ids in prompt_ids.items():
            request = GenerationRequest(ids, MAX_NEW, policy=POLICIES["heuristic"])
            assert engine.generate(request).token_ids == reference[name]
