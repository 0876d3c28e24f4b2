"""A distributed session's round statistics (coordinator/session/round_log.py), on hand-made
timings: each round's parts add up, the return trip lands on its round, the workers' overlap."""

from __future__ import annotations

import pytest

from coordinator.session.round_log import RoundLog, overlap
from svip_common.contracts import Block
from svip_common.messages import DraftedBlock


def _block(tokens, started, finished, draft_s, trigger_at=0.0) -> DraftedBlock:
    entropies = [0.5] * (len(tokens) - 1) + [1.5] if tokens else []
    return DraftedBlock(Block(base=0, tokens=tokens, probs=[], entropies=entropies), started_at=started,
                        finished_at=finished, draft_s=draft_s, trigger_at=trigger_at)


def test_a_rounds_parts():
    log = RoundLog(started=100.0)
    block = _block([5, 6], started=100.0, finished=100.4, draft_s=0.3)
    # received 0.1 s after the draft finished, verified 0.5..0.8, decided at 1.0
    log.round(block, 1, (100.5, 100.5, 100.8, "first"), now=101.0)
    s = log.stats
    assert (s.rounds, s.draft_tokens, s.accepted_tokens, s.stop_entropies) == (1, 2, 1, [1.5])
    assert s.round_s == [pytest.approx(1.0)] and s.target_forward_s == [pytest.approx(0.3)]
    assert s.draft_forward_s == [pytest.approx(0.3)]  # all of its drafting was on the critical path
    assert s.block_transit_s == [pytest.approx(0.1)] and s.target_queue_s == [0.0]
    assert s.overhead_s == [pytest.approx(0.4)] and s.round_sources == ["first"]
    log.feedback_answered(_block([7], 101.3, 101.4, 0.1, trigger_at=101.2), feedback_sent_at=101.0)
    assert s.feedback_transit_s == [pytest.approx(0.2)] and s.draft_queue_s == [pytest.approx(0.1)]


def test_the_target_alone_has_no_drafting_on_its_path():
    log = RoundLog(started=0.0)
    log.round(_block([], 0.0, 0.0, 0.0), 0, (0.0, 0.0, 0.2, "none"), now=0.25)
    assert log.stats.draft_forward_s == [0.0] and log.stats.stop_entropies == [] and log.stats.rounds == 1


def test_final_figures():
    log = RoundLog(started=0.0)
    log.busy("draft", 0.0, 1.0)
    log.busy("target", 0.5, 2.0)
    log.busy("draft", 1.5, 3.0)
    log.wire_bytes = 300
    log.round(_block([5], 0.0, 1.0, 1.0), 1, (1.0, 1.0, 2.0, "first"), now=2.0)
    s = log.final(has_draft=True, now=3.5)
    assert s.draft_busy_s == pytest.approx(2.5) and s.target_busy_s == pytest.approx(1.5)
    assert s.both_busy_s == pytest.approx(1.0) and s.wire_bytes_per_round == 300
    assert [w for w, _, _ in s.timeline] == ["draft", "target", "draft"] and s.wall_s == 3.5


def test_overlap_of_disjoint_interval_sets():
    assert overlap([(0, 2), (3, 5)], [(1, 4)]) == 2
    assert overlap([], [(0, 1)]) == 0 and overlap([(0, 1)], [(1, 2)]) == 0
