"""A follow-up that grows at the target (draft_worker/growth.py), on the draft's side, without a
model: a scripted draft whose policy stops after ``length`` tokens and drafts on past a stop while
the session's clock says so, driven through the target's messages. Where the draft works for other
sessions too (``shared``) the follow-up leaves at its first stop and what it drafts after follows
as growths; the target's feedback says how much of it is verified, and the draft cuts it there and
drafts the next one on from the cut. A session alone on its worker sends its follow-up whole."""

from __future__ import annotations

import time

import pytest

from draft_worker.pipelined import PipelinedDraft
from draft_worker.stepping import work
from svip_common.contracts import NO_TOKEN
from svip_common.errors import InvalidRequest
from svip_common.messages import Feedback
from svip_common.outcome import outcome_of
from tests.unit.test_pipelined_draft import PROMPT, STOP, ScriptedBlock, ScriptedSession, script

LATE = 3600.0  # the verdicts arrive this long after now: the draft always has room before them


class StoppingBlock(ScriptedBlock):
    """A ScriptedBlock whose policy stops at ``length`` tokens (and at every place after), and
    which drafts on past a stop while ``extends()`` says so, up to its budget."""

    def __init__(self, seq, budget: int, length: int, stop_ids):
        super().__init__(seq, budget, budget, stop_ids)
        self.length, self.extends, self.extended = length, None, 0

    def step(self) -> bool:
        super().step()
        if not self.done and len(self.block) >= self.length:
            if self.extends is not None and self.extends():
                self.extended += 1
            else:
                self.done = True
        return self.done

    def cap(self, budget: int) -> bool:
        return False


class StoppingSession(ScriptedSession):
    def begin(self, seq, budget: int, alternatives: bool = False, fork: bool = False) -> StoppingBlock:
        self.begun.append((tuple(seq), budget))
        return StoppingBlock(list(seq), budget, self.length, self.stop_ids)


def session(shared: bool, max_new_tokens: int = 20) -> PipelinedDraft:
    draft = PipelinedDraft(StoppingSession(2), list(PROMPT), max_new_tokens, frozenset({STOP}), True, prepare=0)
    draft.shared = shared
    return draft


def steps(draft: PipelinedDraft, n: int) -> list:
    """n of the worker's forwards for this session; every block it sends, in order."""
    sent = []
    for _ in range(n):
        sent += work(draft, time.time()) or []
    return sent


def followup_verdict(draft: PipelinedDraft, next_tokens: int | None) -> list:
    """The target accepts the oldest outstanding block whole; its follow-up goes on, next_tokens of it."""
    head = draft.outstanding[0].block
    outcome = outcome_of(draft.epoch, head.base, len(head), len(head), NO_TOKEN, (), True, False, next_tokens)
    return draft.on_feedback(time.time(), Feedback("s", outcome), time.time() + LATE)


def test_a_shared_sessions_follow_up_leaves_at_its_first_stop_and_its_growth_follows():
    draft = session(shared=True)
    draft.start(time.time())
    sent = steps(draft, 7)  # two forwards for the first block, two to the follow-up's stop, three past it
    first, followup, growths = sent[0], sent[1], sent[2:]
    assert first.block.base == len(PROMPT) and first.followup and len(first.tokens) == 2
    assert followup.base == first.base + 2 and followup.grows == 0 and followup.followup
    assert [g.grows for g in growths] == [2, 3, 4] and all(g.base == followup.base for g in growths)
    drafted = script(PROMPT + first.tokens, 5)
    assert followup.tokens == drafted  # the draft's own copy grew with it
    assert [t for g in growths for t in g.tokens] == drafted[2:]
    assert draft.outstanding == [first, followup]


def test_the_targets_count_cuts_the_follow_up_and_the_next_drafts_on_from_the_cut():
    draft = session(shared=True)
    draft.start(time.time())
    first, followup = steps(draft, 6)[:2]  # the follow-up holds 4 tokens here, 3 of them at the target
    assert len(followup.tokens) == 4
    assert followup_verdict(draft, 3) == []
    assert draft.known == PROMPT + first.tokens and draft.outstanding == [followup]
    assert followup.tokens == script(PROMPT + first.tokens, 3) and len(followup.alternatives) == 3
    assert draft.growth.job is None and not draft.jobs  # it grows no more
    nxt = steps(draft, 2)
    assert nxt[0].base == followup.base + 3 and nxt[0].grows == 0
    assert draft.session.begun[-1][0] == tuple(PROMPT + first.tokens + followup.tokens)


def test_a_follow_up_that_reached_the_target_after_its_verdict_is_verified_as_first_sent():
    draft = session(shared=True)
    draft.start(time.time())
    first, followup = steps(draft, 6)[:2]
    followup_verdict(draft, None)  # not held there when the verdict came: every growth was dropped
    assert followup.tokens == script(PROMPT + first.tokens, 2)


@pytest.mark.parametrize("shared", [True, False])
def test_feedback_verifying_more_of_a_follow_up_than_was_sent_is_refused(shared):
    draft = session(shared=shared)
    draft.start(time.time())
    steps(draft, 30)
    with pytest.raises(InvalidRequest, match="follow-up"):
        followup_verdict(draft, len(draft.outstanding[1].tokens) + 1)


def test_a_session_alone_on_its_worker_sends_its_follow_up_whole():
    """At one session the target waits for a late follow-up (filling its first place itself):
    nothing grows there, the follow-up leaves when its own clock ends it (measured: the follow-up
    that grows, docs/benchmarks.md)."""
    draft = session(shared=False)
    draft.start(time.time())
    sent = steps(draft, 30)
    assert len(sent) == 2 and not any(item.grows for item in sent)
    assert len(sent[1].tokens) == 20 - 2 - 1  # drafted on to its budget: the verdict is an hour away
    assert followup_verdict(draft, len(sent[1].tokens)) == [] and draft.outstanding == [sent[1]]
