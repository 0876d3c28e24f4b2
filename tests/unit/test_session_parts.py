"""The target-side session's parts on their own, without models or a protocol: the blocks drafted
ahead of a verdict (coordinator/session/ahead.py), recovery's re-attach schedule
(coordinator/session/reattach.py), on a clock the test chooses, and the feedback a session owes
its draft (coordinator/session/feedback.py), and the host's reading of a draft message on its event
loop (coordinator/session/host.py)."""

from __future__ import annotations

import logging

import torch

from coordinator.session import host as host_module
from coordinator.session.ahead import AheadBlocks
from coordinator.session.feedback import FeedbackChain
from coordinator.session.host import read_draft_event
from coordinator.session.pausing import LoadPause
from coordinator.session.reattach import (
    MAX_STALLS,
    REATTACH_BACKOFF_MAX_S,
    REATTACH_BACKOFF_S,
    AttachWait,
    Reattach,
)
from svip_common.acceptance import StopRule
from svip_common.contracts import NO_TOKEN, Block, GenerationStats, Verdict
from svip_common.errors import InvalidRequest
from svip_common.messages import DraftedBlock
from svip_common.step_cost import SessionGate
from svip_proto import convert
from svip_proto import svip_pb2 as pb


def _block(base: int, n: int) -> DraftedBlock:
    return DraftedBlock(Block(base=base, tokens=list(range(n)), probs=[], entropies=[]))


def test_a_followup_taken_is_not_discarded_and_one_dropped_is():
    stats = GenerationStats()
    ahead = AheadBlocks(stats)
    ahead.hold_followup(_block(10, 3), 1.0)
    assert ahead.take_followup()[1] == 1.0 and ahead.followup is None
    ahead.drop_followup()  # nothing left to drop
    assert stats.discarded_tokens == 0
    ahead.hold_followup(_block(10, 3), 2.0)
    ahead.drop_followup()
    assert stats.discarded_tokens == 3 and ahead.followup is None


def test_prepared_blocks_are_taken_by_their_verdict_and_dropped_by_base():
    stats = GenerationStats()
    ahead = AheadBlocks(stats)
    ahead.keep_prepared((10, 1, 5), _block(12, 2), 1.0)
    ahead.keep_prepared((10, 1, 6), _block(12, 4), 1.0)
    ahead.keep_prepared((20, 0, 5), _block(21, 3), 1.0)
    assert stats.prepared_sent == 3
    assert ahead.take_prepared(10, 2, 5) is None  # no block assumed that verdict
    assert len(ahead.take_prepared(10, 1, 5)[0].tokens) == 2
    ahead.drop_prepared(10)  # the other continuation of the same block is void
    assert list(ahead.prepared) == [(20, 0, 5)] and stats.discarded_tokens == 4
    ahead.hold_followup(_block(30, 1), 1.0)
    ahead.drop_all()
    assert ahead.prepared == {} and ahead.followup is None and stats.discarded_tokens == 8


def test_each_stall_doubles_the_backoff_up_to_its_cap_and_retires_the_draft():
    r = Reattach(hold_s=0.0)
    backoffs = []
    for stall in range(MAX_STALLS):
        assert not r.retired
        r.detached(100.0, stalled=True, sampled=False)
        backoffs.append(r.not_before - 100.0)
    assert backoffs == [min(REATTACH_BACKOFF_S * 2**i, REATTACH_BACKOFF_MAX_S) for i in range(MAX_STALLS)]
    assert r.retired
    lost = Reattach(hold_s=0.0)
    lost.detached(100.0, stalled=False, sampled=False)  # a lost draft: no backoff, no stall counted
    assert lost.stalls == 0 and lost.not_before == 0.0


def test_a_backoff_retry_is_due_only_once_it_is_over_and_only_if_asked():
    r = Reattach(hold_s=0.0)
    r.detached(100.0, stalled=True, sampled=False)
    assert not r.backoff_over(200.0)  # nobody asked for a re-attach
    r.waiting = AttachWait.BACKOFF
    assert not r.backoff_over(100.0 + 0.5 * REATTACH_BACKOFF_S)
    assert r.backoff_over(100.0 + REATTACH_BACKOFF_S)
    r.attached()
    assert r.waiting is AttachWait.NONE and not r.backoff_over(200.0)


def test_only_a_sampled_session_holds_and_its_hold_ends_once():
    greedy = Reattach(hold_s=5.0)
    greedy.detached(100.0, stalled=False, sampled=False)
    assert greedy.hold_until is None and not greedy.hold_over(200.0)
    sampled = Reattach(hold_s=5.0)
    sampled.detached(100.0, stalled=False, sampled=True)
    assert not sampled.hold_over(104.0)
    assert sampled.hold_over(105.0)
    assert not sampled.hold_over(106.0) and sampled.hold_until is None
    sampled.detached(200.0, stalled=False, sampled=True)
    sampled.attached()  # a draft took the session up: no hold left
    assert sampled.hold_until is None


def test_feedback_queued_in_one_step_leaves_as_one_message_earliest_first():
    chain = FeedbackChain("s")
    assert chain.take() is None
    chain.add(3, _block(10, 4), Verdict(base=10, accepted=4, token=NO_TOKEN), NO_TOKEN, False, True, 2, None)
    rule = StopRule(stop_at=0.3)
    chain.add(3, _block(14, 2), Verdict(base=14, accepted=0, token=7), 7, True, False, None, rule)
    head = chain.take()
    assert chain.take() is None  # all of it left as one message
    fields = (head.session_id, head.epoch, head.base, head.drafted, head.accepted, head.token)
    assert fields == ("s", 3, 10, 4, 4, NO_TOKEN)
    assert head.load_cap == 2 and head.stop_rule is None and not head.prepared_used
    then = head.then
    assert (then.base, then.drafted, then.accepted, then.token, then.prepared_used) == (14, 2, 0, 7, True)
    assert then.load_cap is None and then.stop_rule == rule and then.then is None
    assert head.chain() == [head, then]


def test_a_sampled_rejection_owes_one_correction_and_a_detach_forgets_it():
    chain = FeedbackChain("s")
    p_row = torch.tensor([0.25, 0.75], dtype=torch.float64)
    chain.add(1, _block(10, 3), Verdict(base=10, accepted=1, token=NO_TOKEN, p_row=p_row), NO_TOKEN, False, False,
              None, None)
    assert chain.correction_due
    assert chain.take().p_row.tolist() == [0.25, 0.75]
    assert chain.take_correction_due() and not chain.take_correction_due()  # due once
    chain.add(1, _block(11, 3), Verdict(base=11, accepted=3, token=NO_TOKEN), NO_TOKEN, False, True, None, None)
    assert not chain.correction_due  # a deferred token: the follow-up settles it
    chain.add(2, _block(14, 3), Verdict(base=14, accepted=0, token=NO_TOKEN), NO_TOKEN, False, False, None, None)
    chain.reset()
    assert not chain.correction_due and chain.take() is None
    chain.add(2, _block(14, 3), Verdict(base=14, accepted=3, token=9), 9, False, False, None, None)
    chain.drop()  # the session is done: nothing leaves, and nothing was owed
    assert chain.take() is None and not chain.correction_due


def test_a_pause_counts_once_gathers_what_the_target_settles_and_resumes_from_where_the_draft_stopped():
    stats = GenerationStats()
    caps = [0]
    pausing = LoadPause(lambda gate: caps[0], SessionGate(), stats)
    assert pausing.cap() == 0 and LoadPause(None, SessionGate(), stats).cap() is None
    pausing.pause()
    pausing.settle([7])
    pausing.settle([8, 9])
    rule = StopRule(stop_at=0.2)
    resume = pausing.resume("s", 4, committed=20, cap=3, stop_rule=rule)
    assert (resume.session_id, resume.epoch, resume.base, resume.tokens) == ("s", 4, 17, (7, 8, 9))
    assert resume.load_cap == 3 and resume.stop_rule == rule and stats.pauses == 1
    assert pausing.resume("s", 4, committed=20, cap=3, stop_rule=None).tokens == ()  # handed over once
    pausing.pause()
    pausing.settle([5])
    pausing.forget()  # detached: the paused draft is gone, and what it was owed with it
    assert pausing.settled == [] and stats.pauses == 2


def test_a_draft_message_is_read_to_its_session_or_to_why_not(monkeypatch, caplog):
    """Read on the event loop, a message becomes its session and what it says, or its session and
    why it cannot be read: a block that breaks a rule, or anything else reading it raises (which
    on the loop would break the link every session shares). No session named: nothing."""
    good = pb.DraftEvent(block=pb.Block(session_id="s", base=3, tokens=[1, 2]))
    session_id, block = read_draft_event(good, 64)
    assert session_id == "s" and isinstance(block, DraftedBlock) and block.tokens == [1, 2]
    bad = pb.Block(session_id="s", base=3, tokens=[1, 2], q_probs=convert.floats_to_proto([0.5]))
    session_id, why = read_draft_event(pb.DraftEvent(block=bad), 64)
    assert session_id == "s" and isinstance(why, InvalidRequest) and "carries 1 probabilities" in str(why)
    assert read_draft_event(pb.DraftEvent(), 64) == (None, None)

    def broken(event, width=None):
        raise ValueError("a reader's bug")

    monkeypatch.setattr(host_module.convert, "draft_event_from_proto", broken)
    with caplog.at_level(logging.ERROR):
        session_id, why = read_draft_event(good, 64)
    assert session_id == "s" and isinstance(why, InvalidRequest) and "ValueError" in str(why)
    assert "could not be read" in caplog.text
