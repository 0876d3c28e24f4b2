"""A follow-up held at the target when its block's forward begins rides that forward (Lookahead,
target_worker/lookahead.py): its tokens are fed after the block, their rows stored, and, once the
block is accepted whole, the follow-up is judged by them, with no forward of its own where they
reach past it. Every verdict equals the one the follow-up gets verified on its own."""

from __future__ import annotations

import pytest

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import Block, GenerationRequest, PolicyConfig, SamplingParams
from target_worker.verifier import Verifier
from tests.integration.test_in_memory import DRAFT_FIRST, Seeded, make_pair


def chain(base: int, tokens: list[int]) -> Block:
    return Block(base=base, tokens=list(tokens), probs=[], entropies=[])


@pytest.fixture(scope="module")
def greedy(models, prompt_ids):
    """A prompt and the target's own greedy tokens after it."""
    prompt = list(prompt_ids["medium"])
    request = GenerationRequest(tuple(prompt), 16, ignore_eos=True)
    return prompt, SpeculativeEngine(models["target"], None).generate(request).token_ids


def verdicts(models, prompt, block, followup, fed):
    """The block verified with ``fed`` after it, then the follow-up: each verdict, and the forwards
    the follow-up took."""
    verifier = Verifier(models["target"], kv_cache_tokens=4096)
    session = verifier.open(SamplingParams())
    verifier.prefill_next([(session, prompt)])  # the prompt in, the next place's row stored
    first = verifier.verify_batch([(session, prompt, block)], lookahead={session: fed} if fed else None)[0]
    committed = prompt + block.tokens[: first.accepted]
    forwards = verifier.pool.forwards
    second = None
    while second is None:
        second = session.judge_first(committed, followup) or verifier.verify_batch([(session, committed, followup)])[0]
    return first, second, verifier.pool.forwards - forwards, verifier


@pytest.mark.parametrize("case", ["whole", "rejected inside", "grew past", "first token rejected"])
def test_a_follow_up_fed_after_its_block_is_judged_as_verified_alone(models, greedy, case):
    prompt, own = greedy
    block = chain(len(prompt), own[:3])
    fed = own[3:6]
    followup = {
        "whole": own[3:6],  # every token judged by a stored row: no forward
        "rejected inside": [own[3], own[4], (own[5] + 1) % 50],  # a stored row rejects its third
        "grew past": own[3:9],  # more arrived after the forward began: a forward for the rest only
        "first token rejected": [(own[3] + 1) % 50, own[4], own[5]],
    }[case]
    fed = followup[:3] if case != "grew past" else fed
    with_rows = verdicts(models, prompt, block, chain(len(prompt) + 3, followup), fed)
    alone = verdicts(models, prompt, block, chain(len(prompt) + 3, followup), ())
    for a, b in zip(with_rows[:2], alone[:2]):
        assert (a.base, a.accepted, a.token) == (b.base, b.accepted, b.token)
    assert with_rows[0].accepted == 3
    assert with_rows[2] == (1 if case == "grew past" else 0)
    assert alone[2] == (0 if case == "first token rejected" else 1)
    assert with_rows[3].fed_ahead == 3 and with_rows[3].judged_ahead == (case in ("whole", "rejected inside"))


def test_rows_fed_after_a_rejected_block_are_dropped(models, greedy):
    """The block is rejected: the rows fed after it hold for nothing; the next block, after the
    target's token, is verified as it is without them."""
    prompt, own = greedy
    block = chain(len(prompt), [own[0], (own[1] + 1) % 50, own[2]])
    with_rows = verdicts(models, prompt, block, chain(len(prompt) + 2, own[2:5]), [own[3], own[4]])
    alone = verdicts(models, prompt, block, chain(len(prompt) + 2, own[2:5]), ())
    assert with_rows[0].accepted == alone[0].accepted == 1 and with_rows[0].token == own[1]
    assert (with_rows[1].accepted, with_rows[1].token) == (alone[1].accepted, alone[1].token)
    assert with_rows[2] == alone[2] == 1


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_greedy_through_the_pair_is_exact_with_follow_ups_judged_by_fed_rows(models, prompt_ids, seed):
    """The in-memory pair under random interleavings: follow-ups are fed after their blocks and
    some are decided by those rows alone; every output equals the target alone's."""
    alone = SpeculativeEngine(models["target"], None)
    pair = make_pair(models, "async", Seeded(seed) if seed != 5 else DRAFT_FIRST, draft="target")
    prompts = list(prompt_ids.values())
    requests = [GenerationRequest(prompts[i % len(prompts)], 20 + 3 * i,
                                  policy=PolicyConfig(name="constant", draft_length=2 + i % 3)) for i in range(6)]
    for request, result in zip(requests, pair.generate_all(requests)):
        assert result.token_ids == alone.generate(request).token_ids
    assert pair.host.verifier.fed_ahead > 0 and pair.host.verifier.judged_ahead > 0
