"""The target's features for a feature draft: a pooled forward returns the model's own hidden
states at the layers asked for, and the verifier hands over, verdict by verdict, exactly the
positions each leaves committed, through rejections and a prompt prefilled in chunks."""

from __future__ import annotations

import pytest
import torch

from svip_common.contracts import Block, SamplingParams
from svip_common.kv_cache import KVPool
from target_worker.verifier import Verifier

PROMPT = [5, 17, 42, 8, 99, 23, 61, 7, 11, 13, 2, 4]


def own_hidden(model, tokens, layers):
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)


class Rounds:
    """A greedy session's rounds on a verifier handing over ``layers``' features: each verdict's
    features kept in order (each starting where the last ended), its tokens committed."""

    def __init__(self, target, layers, budget=None):
        self.verifier = Verifier(target, kv_cache_tokens=1024, feature_layers=layers)
        self.session = self.verifier.open(SamplingParams())
        self.committed, self.handed, self.budget = list(PROMPT), [], budget

    def verify(self, tokens, siblings=None):
        block = Block(base=len(self.committed), tokens=tokens, probs=[0.5] * len(tokens),
                      entropies=[0.1] * len(tokens), siblings=siblings)
        while (verdict := self.verifier.verify_batch([(self.session, self.committed, block)], self.budget)[0]) is None:
            pass  # a prefill chunk this step
        if verdict.features is not None:
            assert verdict.features_from == sum(f.shape[0] for f in self.handed)
            self.handed.append(verdict.features)
        self.committed.extend([*tokens[: verdict.accepted], *verdict.branch, verdict.token])
        return verdict


@torch.inference_mode()
def test_a_pooled_forward_returns_the_models_own_hidden_states(models):
    model = models["target"].model
    layers = (0, 1, model.config.num_hidden_layers)
    pool = KVPool(model, tokens=256, page_size=4)
    a, b = pool.sequence(), pool.sequence()
    rows, feats = pool.forward_features([(a, PROMPT[:5], 1), (b, PROMPT[:9], 2)], layers)
    assert [f.shape for f in feats] == [(5, 3 * model.config.hidden_size), (9, 3 * model.config.hidden_size)]
    assert torch.allclose(feats[0], own_hidden(model, PROMPT[:5], layers), rtol=1e-4, atol=1e-3)
    _, more = pool.forward_features([(a, PROMPT[5:7], 1), (b, [3], 1)], layers)
    assert torch.allclose(more[0], own_hidden(model, PROMPT[:7], layers)[5:], rtol=1e-4, atol=1e-3)
    assert torch.allclose(more[1], own_hidden(model, PROMPT[:9] + [3], layers)[9:], rtol=1e-4, atol=1e-3)
    assert pool.forward_features([(a, [1], 1)])[1] == []  # none asked: none computed


@pytest.mark.parametrize("budget", [None, 5])
def test_verdicts_hand_over_the_features_of_what_they_commit(models, budget):
    """A greedy session over rounds: an empty first block (the prompt, in chunks of 5 under a
    budget), then blocks the target accepts whole, in part and not at all. Joined, the verdicts'
    features cover positions 0 .. len(committed) - 2 once each, in order, and equal the model's
    own hidden states there."""
    target = models["target"]
    layers = (1, 2)
    rounds = Rounds(target, layers, budget)
    committed, handed, verify = rounds.committed, rounds.handed, rounds.verify

    def choice():  # the target's next token after what is committed
        with torch.inference_mode():
            return target.model(input_ids=torch.tensor([committed])).logits[0, -1].argmax().item()

    verify([])
    assert verify([choice()]).accepted == 1  # accepted whole
    nxt = choice()
    assert verify([nxt, (nxt + 1) % 50, 3]).accepted == 1  # accepted in part
    assert verify([(choice() + 1) % 50]).accepted == 0  # rejected
    verify([])
    joined = torch.cat(handed)
    assert joined.shape[0] == len(committed) - 1
    assert torch.allclose(joined, own_hidden(target.model, committed, layers)[:-1], rtol=1e-4, atol=1e-3)


def test_a_trees_verdict_hands_over_the_features_of_its_accepted_path(models):
    """A tree rejected at its second place, where a sibling is the target's choice: the verdict
    hands the features of the accepted spine token and of the sibling, at their places (the other
    nodes' go); then a tree accepted whole hands its spine's. Joined, the features cover the
    committed positions once each and equal the model's own hidden states there."""
    target = models["target"]
    layers = (1, 2)
    rounds = Rounds(target, layers)
    committed, handed, verify = rounds.committed, rounds.handed, rounds.verify

    def choice(tokens):
        with torch.inference_mode():
            return target.model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax().item()

    verify([])
    first = choice(committed)
    second = choice([*committed, first])
    verdict = verify([first, (second + 1) % 50, 3], [[(first + 2) % 50], [(second + 3) % 50, second], [9]])
    assert (verdict.accepted, verdict.branch) == (1, (second,))
    nxt = choice(committed)
    assert verify([nxt], [[(nxt + 1) % 50]]).branch == ()  # accepted whole
    verify([])
    joined = torch.cat(handed)
    assert joined.shape[0] == len(committed) - 1
    assert torch.allclose(joined, own_hidden(target.model, committed, layers)[:-1], rtol=1e-4, atol=1e-3)
