"""The embedded pair: `svip generate` runs with no model flags, through from_pretrained, and its
greedy output equals the target alone; the pair shares one vocabulary; the card is there."""

from __future__ import annotations

import json

import pytest

from svip_assets import PAIR_DIR, default_pair
from svip_cli.main import main
from svip_common.models import check_same_vocabulary, load_model


def test_generate_with_no_model_flags(capsys):
    assert main(["generate", "def fibonacci(n):", "--max-new-tokens", "48", "--json"]) == 0
    speculative = json.loads(capsys.readouterr().out)
    assert speculative["stats"]["config"]["target"].endswith("pair/target")
    assert speculative["stats"]["config"]["draft"].endswith("pair/draft")
    assert main(["generate", "def fibonacci(n):", "--max-new-tokens", "48", "--json", "--draft", "none"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert speculative["token_ids"] == alone["token_ids"]
    assert speculative["stats"]["accepted_tokens"] > 0  # a trained pair agrees on something


def test_pair_loads_and_shares_a_vocabulary():
    target_dir, draft_dir = default_pair()
    target, draft = load_model(target_dir), load_model(draft_dir)
    check_same_vocabulary(target, draft)
    assert sum(p.numel() for p in draft.model.parameters()) * 2 < sum(p.numel() for p in target.model.parameters())
    assert (PAIR_DIR / "MODEL_CARD.md").is_file() and (PAIR_DIR / "split.json").is_file()


def test_chat_template_renders_for_both_models():
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Add two\nnumbers."}]
    for path in default_pair():
        text = AutoTokenizer.from_pretrained(path).apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        assert text == "# system: You write Python.\n# user: Add two\n# numbers.\n# assistant:\n"


@pytest.fixture(scope="module")
def shipped():
    from coordinator.engine import SpeculativeEngine

    target_dir, draft_dir = default_pair()
    target, draft = load_model(target_dir), load_model(draft_dir)
    return SpeculativeEngine(target, draft, load_aware="off"), SpeculativeEngine(target, None)


@pytest.mark.parametrize(
    "policy",
    [
        {"name": "svip"},
        {"name": "svip", "threshold": 0.6},
        {"name": "constant", "draft_length": 4},
        {"name": "heuristic"},
        {"name": "confidence"},
    ],
)
def test_greedy_output_on_the_shipped_pair_equals_the_target_alone(shipped, policy):
    from svip_common.contracts import GenerationRequest, PolicyConfig

    speculative, alone = shipped
    ids = tuple(alone.target.tokenizer("import os\n\ndef walk(path):")["input_ids"])
    request = GenerationRequest(ids, 64, policy=PolicyConfig(**policy), ignore_eos=True)
    result = speculative.generate(request)
    assert result.token_ids == alone.generate(request).token_ids
    assert result.stats.accepted_tokens > 0
