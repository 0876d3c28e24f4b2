"""A greedy draft step's choice on a host device (drafter.py ``_greedy_on_host``, numpy's argmax
over q) is what the batched torch ops give on any other device (softmax, argmax, entropy, topk):
the same tokens and runners-up, their q and the entropy of q within float32's rounding, for
blocks drafted side by side in one step, chains and CaPE trees."""

from __future__ import annotations

import pytest

from draft_worker import drafter as drafter_module
from draft_worker.drafter import Drafter
from svip_common.contracts import PolicyConfig, SamplingParams

PROMPTS = ((5, 6, 7), (11, 3, 9, 4), (200, 17), (42,) * 6)


def drafted(models, tree: str) -> list:
    """Four blocks of eight tokens, one per session, drafted side by side (one step each token)."""
    drafter = Drafter(models["close_draft"], models["target"].vocab_size)
    policy = PolicyConfig(name="constant", draft_length=8, tree=tree)
    sessions = [drafter.open(SamplingParams(), policy, ()) for _ in PROMPTS]
    drafts = [s.begin(list(p), 40, alternatives=True) for s, p in zip(sessions, PROMPTS)]
    while not all(d.done for d in drafts):
        drafter.step(drafts)
    out = [(d.block.tokens, d.block.probs, d.block.entropies, d.alternatives, d.block.siblings) for d in drafts]
    for s in sessions:
        s.close()
    return out


@pytest.mark.parametrize("tree", ["off", "cape"])
def test_the_host_choice_is_the_torch_ops_choice(models, monkeypatch, tree):
    on_host = drafted(models, tree)
    monkeypatch.setattr(drafter_module, "HOST_DEVICES", ())  # every step through the torch ops
    by_torch = drafted(models, tree)
    for (tokens, probs, h, alternatives, siblings), (want_tokens, want_probs, want_h, want_alt, want_sib) in zip(
        on_host, by_torch
    ):
        assert tokens == want_tokens and len(tokens) == 8
        assert probs == pytest.approx(want_probs, abs=1e-6)
        assert h == pytest.approx(want_h, abs=1e-4)
        assert [[i for i, _ in a] for a in alternatives] == [[i for i, _ in a] for a in want_alt]
        assert siblings == want_sib
