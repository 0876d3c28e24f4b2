"""What the target checks of a draft worker's messages (coordinator/session/wire_checks.py): each
hostile or broken field is a WorkerError that names it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from coordinator.session.wire_checks import (
    MAX_PREPARED,
    check_block,
    check_correction,
    check_growth,
    check_held,
    check_prepared,
    check_timings,
)
from svip_common.contracts import Block, GenerationRequest, Limits, PolicyConfig, SamplingParams
from svip_common.errors import WorkerError
from svip_common.messages import DraftedBlock
from svip_common.trees import MAX_TREE_NODES

LIMITS = Limits(tokens=50, positions=None, max_draft_length=4)
GREEDY = GenerationRequest((1, 2, 3), max_new_tokens=10)


def _block(tokens, base=3, probs=True) -> DraftedBlock:
    return DraftedBlock(Block(base=base, tokens=tokens, probs=[0.9] * len(tokens) if probs else [],
                              entropies=[0.1] * len(tokens)))


@pytest.mark.parametrize("field", ["started_at", "finished_at", "draft_s", "trigger_at"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 1e12 * 1.001, 1e308])
def test_timings_must_be_finite_not_negative_and_a_clocks(field, value):
    with pytest.raises(WorkerError, match=field):
        check_timings(DraftedBlock(_block([]).block, **{field: value}))
    check_timings(DraftedBlock(_block([]).block, **{field: 1.5}))
    check_timings(DraftedBlock(_block([]).block, **{field: 2e9}))  # a wall clock's reading (time.time())


def test_a_good_block_comes_back_as_the_projects_block():
    checked = check_block(_block([5, 6]), 3, GREEDY, LIMITS)
    assert checked.base == 3 and checked.tokens == [5, 6] and len(checked.entropies) == 2


@pytest.mark.parametrize("block, request_, message", [
    (_block([5], base=2), GREEDY, "base 2, committed 3"),
    (_block([5, 50]), GREEDY, "token id"),
    (_block([5, 6, 7, 8, 9]), GREEDY, "the cap is 4"),
    (_block([5, 6, 7]), GenerationRequest((1, 2, 3), max_new_tokens=3), "past the session's 6 tokens"),
    (_block([5], probs=False), GenerationRequest((1, 2, 3), 10, SamplingParams(temperature=1.0)), "q\\(d\\)"),
])
def test_a_bad_block_is_refused_naming_why(block, request_, message):
    with pytest.raises(WorkerError, match=message):
        check_block(block, 3, request_, LIMITS)


def _tree(siblings, tokens=(5, 6), q_rows=None) -> DraftedBlock:
    return DraftedBlock(Block(base=3, tokens=list(tokens), probs=[0.9] * len(tokens), entropies=[0.1] * len(tokens),
                              siblings=siblings, q_rows=q_rows))


def _deep(grown, siblings=([7], [])) -> DraftedBlock:
    tree = _tree([list(options) for options in siblings])
    tree.block.grown = list(grown)
    return tree


CAPE = GenerationRequest((1, 2, 3), 10, policy=PolicyConfig(name="svip", threshold=0.4, tree="cape"))
DEEP = dataclasses.replace(CAPE, policy=PolicyConfig(name="svip", threshold=0.4, tree="deep"))
SAMPLED_CAPE = dataclasses.replace(CAPE, sampling=SamplingParams(temperature=1.0))
Q_ROWS = torch.full((2, 50), 1 / 50)  # a sampled tree's q at each place (their shape checked as they are read)


def test_a_tree_where_the_session_asked_for_one_comes_back_whole():
    assert check_block(_tree([[7, 8], []]), 3, CAPE, LIMITS).siblings == [[7, 8], []]
    assert check_block(_deep([(2, 9), (2, 10), (3, 9)]), 3, DEEP, LIMITS).grown == [(2, 9), (2, 10), (3, 9)]
    assert check_block(_tree([[7, 8], []], q_rows=Q_ROWS), 3, SAMPLED_CAPE, LIMITS).q_rows is Q_ROWS


@pytest.mark.parametrize("block, request_, message", [
    (_tree([[7], []]), GREEDY, "drafts chains"),
    (_tree([[7], []]), dataclasses.replace(SAMPLED_CAPE, policy=GREEDY.policy), "drafts chains"),
    (_tree([[7], []]), SAMPLED_CAPE, "a sampled tree without its q rows"),
    (_tree([[7], []], q_rows=Q_ROWS), CAPE, "q rows with a greedy tree"),
    (DraftedBlock(dataclasses.replace(_block([5, 6]).block, q_rows=Q_ROWS)), SAMPLED_CAPE, "q rows with a chain"),
    (_tree([[5], []]), CAPE, "repeat a token"),
    (_tree([[7, 7], []]), CAPE, "repeat a token"),
    (_tree([[7]]), CAPE, "1 lists of siblings for 2"),
    (_tree([[7, 50], []]), CAPE, "sibling token id"),
    (_tree([list(range(7, 7 + MAX_TREE_NODES)), []]), CAPE, f"the cap is {MAX_TREE_NODES}"),
    (_deep([(2, 9)]), CAPE, "trees do not grow"),
    (_deep([(1, 9)]), DEEP, "not a node off the spine"),  # node 1 is the spine's second token
    (_deep([(3, 9)]), DEEP, "not a node off the spine"),  # node 3 is itself
    (_deep([(2, 9), (2, 9)]), DEEP, "repeats token 9 under node 2"),
    (_deep([(2, 50)]), DEEP, "grown token id"),
    (_deep([(2, 9)] + [(3, t) for t in range(MAX_TREE_NODES)]), DEEP, f"the cap is {MAX_TREE_NODES}"),
])
def test_a_bad_tree_is_refused_naming_why(block, request_, message):
    limits = Limits(tokens=50 + MAX_TREE_NODES, positions=None, max_draft_length=4) if "cap" in message else LIMITS
    with pytest.raises(WorkerError, match=message):
        check_block(block, 3, request_, limits)


def test_prepared_blocks_within_reach_and_count():
    check_prepared(3 + 3 * 5, 3, 0, LIMITS)
    with pytest.raises(WorkerError, match="reach"):
        check_prepared(3 + 3 * 5 + 1, 3, 0, LIMITS)
    with pytest.raises(WorkerError, match=f"{MAX_PREPARED} kept"):
        check_prepared(4, 3, MAX_PREPARED, LIMITS)


def test_a_correction_only_when_asked_and_in_range():
    assert check_correction(7, True, LIMITS) == 7
    with pytest.raises(WorkerError, match="no feedback asked"):
        check_correction(7, False, LIMITS)
    with pytest.raises(WorkerError, match="correction token id"):
        check_correction(50, True, LIMITS)


@pytest.mark.parametrize("block, message", [
    (_block([5, 50], base=9), "token id"),
    (_block([5, 6, 7, 8, 9], base=9), "the cap is 4"),
    (_block([5, 6, 7], base=11), "past the session's 13 tokens"),
])
def test_a_follow_up_is_checked_as_it_comes_wherever_it_starts(block, message):
    """A follow-up held while its block waits: its tokens may ride that block's forward
    (target_worker/lookahead.py), so ids, cap and budget are checked before it is held; its base
    only once it is verified."""
    assert check_held(_block([5, 6], base=9), GREEDY, LIMITS).tokens == [5, 6]
    with pytest.raises(WorkerError, match=message):
        check_held(block, GREEDY, LIMITS)


def test_a_growth_past_the_sessions_budget_is_refused():
    grown = DraftedBlock(_block([5, 6], base=9).block, grows=1)
    check_growth(grown, GREEDY, LIMITS)  # 9 + 1 + 2 tokens, the next place the 13th
    with pytest.raises(WorkerError, match="past the session's 13 tokens"):
        check_growth(DraftedBlock(_block([5, 6], base=9).block, grows=2), GREEDY, LIMITS)
