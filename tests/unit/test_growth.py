"""A follow-up that grows at the target (draft_worker/growth.py), on the draft's side, without a
model: a scripted draft whose policy stops after ``length`` tokens and drafts on past a stop while
the session's clock says so, driven through the target's messages. Where the draft works for other
sessions too (``shared``) the follow-up leaves at its first stop and what it drafts after follows
as growths; the target's feedback says how much of it is verified, the draft cuts it there, and
what it drafted past the cut goes on as the next one (nothing drafted again). A session alone on
its worker sends its follow-up whole."""

from __future__ import annotations

import time

import pytest

from draft_worker.pipelined import PipelinedDraft
from draft_worker.stepping import work
from svip_common.contracts import NO_TOKEN, Block
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

    def split_off(self, keep: int) -> None:  # BlockDraft's: the tokens past the cut are the block
        block = self.block
        self.block = Block(base=block.base + keep, tokens=block.tokens[keep:], probs=block.probs[keep:],
                           entropies=block.entropies[keep:])
        self.alternatives = self.alternatives[keep:]
        self._limit -= keep


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


@pytest.mark.parametrize("price, grown", [(0.0, 15), (0.7, 2), (0.85, 0), (0.95, 0)])
def test_a_shared_follow_up_drafts_past_its_stop_while_its_chance_beats_the_targets_node_price(price, grown):
    """Where sessions share the target, a token drafted past the policy's stop costs every session
    in the target's step a verified node; the follow-up drafts on while the chance that the block
    holds up to its last token (each q 0.9: 0.81 at its stop, 0.729, 0.656, ...) beats that price."""
    draft = session(shared=True)
    draft.session.node_price = price
    draft.start(time.time())
    sent = steps(draft, 30)
    followup = sent[1]
    assert followup.grows == 0 and len(followup.tokens) == 2 + grown
    assert [g.grows for g in sent[2:]] == list(range(2, 2 + grown))
    assert draft.growth.job is None  # it ended: at its budget (20 new tokens, less the first block's 2
    # and the verdict's own) or its price


def test_a_follow_up_alone_on_its_worker_drafts_past_its_stop_whatever_a_node_costs():
    """At one session a critical block steps alone and the follow-up's rows ride for free: the
    target's node price does not end it (the verdict's timing does)."""
    draft = session(shared=False)
    draft.session.node_price = 0.95
    draft.start(time.time())
    sent = steps(draft, 30)
    assert [(len(item.tokens), item.grows) for item in sent[1:]] == [(17, 0)]  # sent whole, to its budget


def test_the_targets_count_cuts_the_follow_up_and_what_it_drafted_past_the_cut_goes_on_as_the_next():
    draft = session(shared=True)
    draft.start(time.time())
    first, followup = steps(draft, 6)[:2]  # the follow-up holds 4 tokens here, 3 of them at the target
    assert len(followup.tokens) == 4
    job, begun = draft.growth.job, len(draft.session.begun)
    drafted = script(PROMPT + first.tokens, 4)
    rest = followup_verdict(draft, 3)  # the 4th is the next follow-up, sent now: nothing is drafted again
    assert draft.known == PROMPT + first.tokens and followup.tokens == drafted[:3] and len(followup.alternatives) == 3
    assert [(item.base, item.tokens, item.grows, item.followup) for item in rest] == [
        (followup.base + 3, drafted[3:], 0, True)]
    assert len(rest[0].alternatives) == 1
    assert draft.outstanding == [followup, rest[0]] and draft.growth.job is job and draft.jobs == [job]
    growths = steps(draft, 2)  # the job drafts on, as the next follow-up's growth
    assert [(g.base, g.grows) for g in growths] == [(rest[0].base, 1), (rest[0].base, 2)]
    assert rest[0].tokens == script(PROMPT + first.tokens, 6)[3:] and len(draft.session.begun) == begun


def test_a_follow_up_cut_after_it_stopped_growing_sends_the_rest_as_the_next_finished():
    """Its budget ended it: what it drafted past the cut goes as the next follow-up, whole, and the
    one after it is drafted on top of that."""
    draft = session(shared=True, max_new_tokens=8)
    draft.start(time.time())
    first, followup = steps(draft, 12)[:2]
    assert draft.growth.job is None and len(followup.tokens) == 8 - 2 - 1  # to its budget
    drafted = list(followup.tokens)
    rest = followup_verdict(draft, 2)
    assert [(item.base, item.tokens, item.grows) for item in rest] == [(followup.base + 2, drafted[2:], 0)]
    assert not rest[0].followup  # the budget's last place is the verdict's own token
    assert draft.outstanding == [followup, rest[0]] and followup.tokens == drafted[:2] and not draft.jobs


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
