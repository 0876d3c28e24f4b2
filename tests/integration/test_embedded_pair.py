"""The embedded pair: `svip generate` runs with no model flags, through from_pretrained, and its
greedy output equals the target alone; the pair shares one vocabulary; the card is there."""

from __future__ import annotations

import json

from svip_cli.main import main
from svip_assets import PAIR_DIR, default_pair
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
    assert sum(p.numel() for p in draft.model.parameters()) * 10 < sum(p.numel() for p in target.model.parameters())
    assert (PAIR_DIR / "MODEL_CARD.md").is_file() and (PAIR_DIR / "split.json").is_file()
