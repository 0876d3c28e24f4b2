"""A prepared continuation sent before it ended (stepping.py ``_sent_now``), on the draft's side,
without a model: the scripted draft of test_growth.py, whose policy stops after two tokens and
which drafts on past a stop while the session's clock says another forward fits. Where the worker
drafts for several sessions, a continuation drafting on past its stop is sent as it stands once
its verdict is near (the target holds it for that verdict) and drafts on; when it ends, the rest
follows as a growth. A verdict that uses it names how many of its tokens the target verifies;
what the draft drafted past them goes on as the next follow-up, nothing drafted again."""

from __future__ import annotations

import time

import pytest

from draft_worker.pipelined import PipelinedDraft
from svip_common.errors import InvalidRequest
from svip_common.messages import Feedback
from svip_common.outcome import PREPARED, outcome_of
from tests.unit.test_growth import StoppingSession, steps
from tests.unit.test_pipelined_draft import PROMPT, STOP, runner_up, script

FORWARD = 1000.0  # a draft forward, as the session's clock has learnt it (seconds)
WAIT = 2.5 * FORWARD  # a verdict's wait: another forward fits before it, two more do not


class Fixed:
    """A learnt estimate held at one value (the test's clock, not the steps' real times)."""

    def __init__(self, value: float):
        self.value = value

    def update(self, sample: float) -> None:
        pass


def session(shared: bool) -> PipelinedDraft:
    draft = PipelinedDraft(StoppingSession(2), list(PROMPT), 10, frozenset({STOP}), True, prepare=2)
    draft.shared = shared
    draft.parallel, draft.session.can_fork = 2, True  # the worker's continuations, side by side (on forks)
    draft.timing.forward_s, draft.timing.verdict_wait = Fixed(FORWARD), Fixed(WAIT)
    return draft


def until_sent_early(draft: PipelinedDraft) -> tuple:
    """Forwards until a continuation is sent before it ended: (the first block, the item, its job)."""
    sent = []
    for _ in range(40):
        sent += steps(draft, 1)
        early = [item for item in sent if item.prepared_for is not None]
        if early:
            job = next(job for job in draft.jobs if job.prepared_for == early[0].prepared_for)
            return sent[0], early[0], job
    raise AssertionError("no continuation was sent before it ended")


def uses(draft: PipelinedDraft, first, key, verified: int | None) -> list:
    """The target rejects the first block at key's place, settles key's token there and verifies
    ``verified`` tokens of the continuation prepared for it."""
    outcome = outcome_of(draft.epoch + 1, first.base, len(first.tokens), key[1], key[2], (), False, True, verified)
    assert outcome.next == PREPARED
    return draft.on_feedback(time.time(), Feedback("s", outcome), time.time())


def test_a_continuation_drafting_on_near_its_verdict_is_sent_as_it_stands_and_its_rest_follows_as_a_growth():
    draft = session(shared=True)
    draft.start(time.time())
    first, early, job = until_sent_early(draft)
    key = early.prepared_for
    assert key == (first.base, 0, runner_up(first.tokens[0]))  # the likeliest rejection
    drafted = script(PROMPT + [key[2]], 8)  # to its budget: 10 new tokens, less the first and the verdict's
    assert early.grows == 0 and early.base == first.base + 1 and early.tokens == drafted[:2]
    assert not job.draft.done and job.draft.extended  # it drafts on past its stop
    rest = steps(draft, 10)
    assert not any(item.prepared_for == key and not item.grows for item in rest)  # sent once
    growth = [item for item in rest if item.prepared_for == key]
    assert [(g.base, g.grows, g.tokens) for g in growth] == [(early.base, 2, drafted[2:])]
    assert early.tokens == drafted[:2]  # as sent: the job's own block went on


def test_a_verdict_using_it_as_sent_makes_what_it_drafted_past_that_the_next_follow_up():
    draft = session(shared=True)
    draft.start(time.time())
    first, early, job = until_sent_early(draft)
    steps(draft, 1)  # it drafts a token more
    key, begun = early.prepared_for, len(draft.session.begun)
    drafted = list(job.draft.block.tokens)
    assert len(drafted) == 3
    out = uses(draft, first, key, 2)
    assert draft.known == PROMPT + [key[2]] and early.block.epoch == draft.epoch
    assert [(item.base, item.tokens, item.grows, item.followup) for item in out] == [
        (early.base + 2, drafted[2:], 0, True)]
    assert draft.outstanding == [early, out[0]]
    assert draft.jobs == [job] and draft.growth.job is job and job.followup  # it grows on as the follow-up
    assert len(draft.session.begun) == begun  # nothing drafted again
    grown = steps(draft, 1)
    assert [(g.base, g.grows) for g in grown if g.prepared_for is None] == [(out[0].base, 1)]


def test_a_verdict_using_it_as_grown_verifies_the_block_as_it_ended():
    draft = session(shared=True)
    draft.start(time.time())
    first, early, job = until_sent_early(draft)
    steps(draft, 10)  # it ends, and its rest is sent as a growth
    key = early.prepared_for
    whole = draft.prepared.blocks[key]
    assert len(whole.tokens) == 8 and key not in {j.prepared_for for j in draft.jobs}
    assert uses(draft, first, key, 8) == []  # nothing past it: the next follow-up is drafted after it
    assert draft.outstanding == [whole] and whole.block.epoch == draft.epoch


@pytest.mark.parametrize("verified", [1, 3, 9])
def test_a_verdict_verifying_other_than_what_was_sent_is_refused(verified):
    draft = session(shared=True)
    draft.start(time.time())
    first, early, _ = until_sent_early(draft)
    with pytest.raises(InvalidRequest, match=f"verifies {verified} tokens of a prepared continuation"):
        uses(draft, first, early.prepared_for, verified)


def test_a_session_alone_on_its_worker_sends_each_continuation_whole():
    """At one session the target waits for a late continuation: each leaves when it ends."""
    draft = session(shared=False)
    draft.start(time.time())
    sent = steps(draft, 60)
    prepared = [item for item in sent if item.prepared_for is not None]
    assert prepared and not any(item.grows for item in prepared)
    key = (sent[0].base, 0, runner_up(sent[0].tokens[0]))
    assert next(item for item in prepared if item.prepared_for == key).tokens == script(PROMPT + [key[2]], 8)
