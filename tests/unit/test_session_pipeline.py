"""The target side's protocol state machine (coordinator/session/pipeline.py), without a model:
the test plays both the draft worker (it delivers blocks, reads the feedback) and the verifier (it
answers each block the session queues with a verdict it chooses), and checks what the session
sends the draft, what it settles for the caller, and which state it is in. The protocol runs end
to end with real models and workers in tests/integration; here each transition is pinned down on
its own."""

from __future__ import annotations

import math

import pytest

from coordinator.session.effects import Finish, Settle, ToDraft, Verify
from coordinator.session.pipeline import DraftMode, SessionPipeline
from svip_common.acceptance import AutoEstimate, SessionStop
from svip_common.contracts import (
    NO_TOKEN,
    Block,
    GenerationRequest,
    Limits,
    PolicyConfig,
    SamplingParams,
    Verdict,
)
from svip_common.messages import (
    Cancel,
    DraftClosed,
    DraftedBlock,
    DraftFailed,
    DraftRequest,
    Feedback,
    Resume,
    SessionStart,
)
from svip_common.step_cost import TargetLoad

PROMPT = (7, 8, 9)
STOP = 0
LIMITS = Limits(tokens=50, positions=None, max_draft_length=8)


KINDS = {"start": SessionStart, "feedback": Feedback, "resume": Resume, "cancel": Cancel}


class Draft:
    """The draft worker's end: what the session sent it (ToDraft effects), and whether one is connected."""

    def __init__(self):
        self.sent: list[DraftRequest] = []
        self.available = True

    def last(self, kind: str):
        return [r for r in self.sent if isinstance(r, KINDS[kind])][-1]

    def count(self, kind: str) -> int:
        return sum(isinstance(r, KINDS[kind]) for r in self.sent)


class Target:
    """A TargetSession stand-in: the test gives every verdict (no early judgement from a stored
    row), and the target's own token at a place where the test stores one (``own``)."""

    cached_tokens = 0
    closed = False

    def __init__(self):
        self.own: dict[int, int] = {}  # place -> the target's token there, from a stored row
        self.judged = 0  # drafted tokens judged against the target's own tokens

    def judge_first(self, committed, block):
        return None

    def judged_alone(self, tokens: int) -> None:
        self.judged += tokens

    def next_token(self, committed):
        return self.own.get(len(committed))

    def settled_logprobs(self, sequence, count: int) -> list:
        return []  # the request asked for none

    def close(self) -> None:
        self.closed = True


class Harness:
    """Plays the host: runs the session's events at its clock and carries out their effects."""

    def __init__(self, pipeline: str = "sync", max_new_tokens: int = 20, draft: bool = True, load_cap=None,
                 sampling: SamplingParams | None = None, auto: SessionStop | None = None, load=lambda: None,
                 tree: str = "off"):
        self.draft, self.events, self.queue, self.checked, self.target = Draft(), [], [], [], Target()
        self.clock = 1.0
        policy = PolicyConfig(name="svip" if auto is None else "auto", tree=tree)
        self.session = SessionPipeline(
            "s", GenerationRequest(PROMPT, max_new_tokens, sampling or SamplingParams(), policy),
            frozenset({STOP}), LIMITS, self.target, draft, pipeline, self.clock, load_cap=load_cap, auto=auto,
            load=load,
        )
        self.do = Events(self)

    def apply(self, effects: list) -> list:
        """The host's half: each effect as the host carries it out, kept for the test to read."""
        for effect in effects:
            if isinstance(effect, ToDraft):
                self.draft.sent.append(effect.request)
            elif isinstance(effect, Verify):
                self.queue.append((effect.block, (effect.received_at, effect.source)))
                self.checked.append(effect.checked)  # what the verifier judges: the block, or what follows the own
            elif isinstance(effect, Settle):
                self.events.append(("settled", list(effect.tokens)))
            elif isinstance(effect, Finish):
                self.events.append(("finished", effect.reason))
        return effects

    def now(self) -> float:
        self.clock += 0.001
        return self.clock

    def start(self) -> list:
        return self.do.start(self.draft.available)

    def block(self, tokens: list[int], base: int | None = None, epoch: int | None = None, **fields) -> DraftedBlock:
        s = self.session
        fields = {"started_at": 1.0, "finished_at": 1.0, "draft_s": 0.001, **fields}
        block = Block(base=s.draft_base if base is None else base, tokens=tokens, probs=[],
                      entropies=[0.3] * len(tokens), epoch=s.epoch if epoch is None else epoch)
        return DraftedBlock(block, **fields)

    def deliver(self, block: DraftedBlock) -> None:
        self.do.on_draft_event(block, self.clock, 100, self.draft.available)

    def verify(self, accepted: int, token: int) -> DraftedBlock:
        """The verifier's verdict on what was queued (accepted of its tokens, then token)."""
        block, (received_at, source) = self.queue.pop(0)
        checked = self.checked.pop(0)
        now = self.clock
        self.do.verified(block, Verdict(checked.base, accepted, token), received_at, source, now, now)
        return block

    def fill(self, *tokens: int) -> None:
        """The target, idle while the session waits, settles its own tokens one by one."""
        for token in tokens:
            assert self.session.wants_fill()
            self.target.own[len(self.session.committed)] = token
            assert any(isinstance(effect, Settle) for effect in self.do.fill(1.0, 1.0))

    @property
    def tokens(self) -> list[int]:
        return [t for kind, tokens in self.events if kind == "settled" for t in tokens]

    @property
    def finish_reason(self) -> str | None:
        done = [reason for kind, reason in self.events if kind == "finished"]
        return done[0] if done else None


class Events:
    """The session's events, each run at the harness's clock, its effects carried out and returned."""

    def __init__(self, harness: Harness):
        self._harness = harness

    def __getattr__(self, name: str):
        event = getattr(self._harness.session, name)
        return lambda *args, **kwargs: self._harness.apply(event(self._harness.now(), *args, **kwargs))


def test_start_opens_the_draft_session_on_the_prompt():
    h = Harness()
    h.start()
    start = h.draft.last("start")
    assert list(start.prompt_ids) == list(PROMPT) and start.max_new_tokens == 20 and start.epoch == 0
    assert start.pipeline == "sync" and sorted(start.stop_token_ids) == [STOP]
    assert h.queue == [] and h.session.waiting_since is not None  # it waits on the draft's block


def test_a_round_verifies_the_block_settles_and_feeds_back():
    h = Harness()
    h.start()
    h.deliver(h.block([11, 12, 13]))
    assert len(h.queue) == 1 and h.session.verifying is not None
    h.verify(3, 14)  # all accepted, and a bonus token
    assert h.tokens == [11, 12, 13, 14] and h.session.committed == [*PROMPT, 11, 12, 13, 14]
    fb = h.draft.last("feedback")
    assert (fb.epoch, fb.base, fb.drafted, fb.accepted, fb.token) == (0, 3, 3, 3, 14)
    assert h.session.stats.rounds == 1 and h.session.stats.accepted_lengths == [3]


@pytest.mark.parametrize("pipeline, held_s", [("sync", 0.001), ("async", 0.012 / 4)])
def test_auto_prices_a_waited_for_block_by_what_it_held_its_session(pipeline, held_s):
    """Policy auto: a block the target waited for held its session for every draft step it rode.
    In sync a step carries only such blocks, so its share of them (draft_s) is its price; in
    async follow-ups and prepared continuations ride the same steps, so it counts the steps it
    rode over the sessions a target step serves (the target served the others meanwhile). auto's
    round trip is what the round took beyond those steps."""
    estimate = AutoEstimate(prior_cost=0.25)
    h = Harness(pipeline, auto=SessionStop(estimate, True), load=lambda: TargetLoad(100.0, 0.0005, batch=4.0))
    h.start()
    # three tokens over 12 ms of the draft's steps, of which its own rows' share was 1 ms
    h.deliver(h.block([11, 12, 13], started_at=1.0, finished_at=1.012, draft_s=0.001))
    h.verify(1, 20)
    assert estimate.drafting.steps == 1 and estimate.drafting.fixed == pytest.approx(held_s)
    h.clock += 0.05  # the feedback out, 10 ms of drafting (1 ms its share), the block back
    h.deliver(h.block([30, 31], started_at=5.0, finished_at=5.010, draft_s=0.001, trigger_at=5.0))
    assert h.session.gate.round_s == pytest.approx(0.05 - 0.001)  # the gate's: beyond its share
    assert h.session.auto.round_trip.value == pytest.approx(0.05 - 0.010)


def test_a_rejection_advances_the_epoch_and_a_stale_block_is_never_verified():
    h = Harness()
    h.start()
    h.deliver(h.block([11, 12, 13]))
    h.verify(1, 20)
    assert h.tokens == [11, 20] and h.session.epoch == 1 and h.draft.last("feedback").epoch == 1
    h.deliver(h.block([30, 31], base=5, epoch=0))  # drafted before the verdict: a rolled-back base
    assert h.queue == [] and h.session.stats.discarded_tokens == 2
    h.deliver(h.block([30, 31]))
    assert len(h.queue) == 1


def test_async_verifies_the_follow_up_with_no_round_trip_on_a_full_acceptance():
    h = Harness(pipeline="async")
    h.start()
    h.deliver(h.block([11, 12], followup=True))
    h.deliver(h.block([13, 14], base=5))  # the follow-up, written while the first is verified
    assert len(h.queue) == 1 and h.session.ahead.followup is not None
    h.verify(2, NO_TOKEN)
    fb = h.draft.last("feedback")
    assert (fb.accepted, fb.token) == (2, NO_TOKEN)  # deferred: the follow-up settles the next place
    assert [b.base for b, _ in h.queue] == [5] and h.queue[0][1][1] == "followup"
    h.verify(1, 40)
    assert h.tokens == [11, 12, 13, 40]


def test_a_prepared_continuation_is_verified_next_when_the_rejection_matches_it():
    h = Harness(pipeline="async")
    h.start()
    h.deliver(h.block([11, 12, 13]))
    prepared = h.block([21, 22], base=5, prepared_for=(3, 1, 20))
    h.deliver(prepared)
    h.deliver(h.block([23], base=5, prepared_for=(3, 1, 25)))
    assert h.session.stats.prepared_sent == 2 and len(h.queue) == 1
    h.verify(1, 20)
    fb = h.draft.last("feedback")
    assert fb.prepared_used and fb.token == 20 and fb.epoch == 1
    (block, (_, source)), = h.queue
    assert source == "prepared" and list(block.tokens) == [21, 22] and block.epoch == 1
    assert h.session.ahead.prepared == {}  # the other one is void


@pytest.mark.parametrize("prepared, used, checked", [
    ([30, 40, 42], True, (7, [42])),  # begins with the child and the target's token: verified after them
    ([30, 41], True, None),  # begins with the child only: decided by the target's token, no forward
    ([31, 40], False, None),  # begins with another token: not the continuation the branch calls for
])
def test_a_continuation_prepared_after_a_sibling_serves_a_deep_branch_that_begins_it(prepared, used, checked):
    """A deep tree's verdict takes a sibling (20) and the child grown below it (30), then settles
    40: the continuation prepared after the sibling is verified next if it begins with the child,
    after the tokens the verdict settled (the draft's next block starts right after the sibling)."""
    h = Harness(pipeline="async")
    h.start()
    h.deliver(h.block([11, 12, 13]))
    h.deliver(h.block(prepared, base=5, prepared_for=(3, 1, 20)))
    block, (received_at, source) = h.queue.pop(0)
    h.checked.pop(0)
    h.do.verified(block, Verdict(3, 1, 40, branch=(20, 30)), received_at, source, h.clock, h.clock)
    fb = h.draft.last("feedback")
    assert fb.prepared_used is used and (fb.accepted, fb.branch, fb.token) == (1, (20, 30), 40)
    assert h.tokens[:4] == [11, 20, 30, 40]
    if not used:
        assert h.queue == [] and h.session.draft_base == 7  # the draft's next block: after the token
        return
    assert h.session.stats.prepared_used == 1
    if checked is None:  # parted from the target's 40: decided at once, one accepted (the child)
        assert h.queue == [] and h.draft.last("feedback").accepted == 1 and h.tokens == [11, 20, 30, 40]
        return
    (verified, (_, source)), = h.queue
    assert source == "prepared" and verified is not block and (h.checked[0].base, list(h.checked[0].tokens)) == checked


@pytest.mark.parametrize("bad, why", [
    (dict(draft_s=math.nan), "draft_s"),
    (dict(base=2), "base 2"),
    (dict(tokens=[11, 99]), "token id"),
    (dict(tokens=list(range(1, 10))), "cap is 8"),
])
def test_a_bad_block_gives_the_draft_up_and_the_target_goes_on_alone(bad, why, caplog):
    h = Harness()
    h.start()
    tokens = bad.pop("tokens", [11, 12])
    h.deliver(h.block(tokens, **bad))
    assert h.session.mode is DraftMode.GIVEN_UP and h.session.detached and why in caplog.text
    assert h.draft.count("cancel") == 1  # the draft's session is closed there
    (block, (_, source)), = h.queue
    assert len(block.tokens) == 0 and source != "drafted"  # the target settles the next token alone
    h.verify(0, 15)
    assert h.tokens == [15] and not h.session.done
    h.do.attach()  # a draft that failed the session never takes it up again
    assert h.session.mode is DraftMode.GIVEN_UP and h.draft.count("start") == 1


@pytest.mark.parametrize("tokens, why", [([13, 99], "token id"), (list(range(13, 22)), "cap is 8")])
def test_a_bad_follow_up_gives_the_draft_up_as_it_comes_and_the_block_in_flight_stands(tokens, why, caplog):
    """A follow-up is checked before it is held (its block's forward may feed its tokens,
    target_worker/lookahead.py): a bad one gives the draft up at once; the block being verified
    is decided as it would have been, and the target goes on alone."""
    h = Harness(pipeline="async")
    h.start()
    h.deliver(h.block([11, 12], followup=True))
    h.deliver(h.block(tokens, base=5))
    assert h.session.mode is DraftMode.GIVEN_UP and h.session.ahead.followup is None and why in caplog.text
    h.verify(2, 40)  # the block in flight, accepted whole: the target's own token follows it
    assert h.tokens == [11, 12, 40] and not h.session.done
    (block, _), = h.queue
    assert len(block.tokens) == 0  # the target settles the next token alone


def test_a_message_the_edge_could_not_read_gives_the_draft_up_and_cancels_its_session(caplog):
    h = Harness()
    h.start()
    h.do.on_bad_draft_message("draft worker sent a bad block: block of 2 tokens carries 1 entropies")
    assert h.session.mode is DraftMode.GIVEN_UP and h.draft.count("cancel") == 1 and "1 entropies" in caplog.text
    (block, _), = h.queue
    assert len(block.tokens) == 0  # the target settles the next token alone
    lost = Harness()
    lost.start()
    lost.draft.available = False
    lost.do.detach(cancel=False)
    lost.do.on_bad_draft_message("junk from the old draft")  # a detached session ignores the old draft
    assert lost.session.mode is DraftMode.DETACHED and lost.draft.count("cancel") == 0


def test_a_draft_error_gives_the_draft_up_and_a_shed_session_goes_on_alone_without_a_hold():
    h = Harness()
    h.start()
    h.do.on_draft_event(DraftFailed("s", 8, "its KV pool is full"), h.clock, 40, True)
    assert h.session.mode is DraftMode.GIVEN_UP and h.draft.count("cancel") == 0  # its session there is gone
    assert len(h.queue) == 1 and h.session.log.wire_bytes >= 40
    shed = Harness()
    shed.start()
    shed.do.on_draft_event(DraftClosed("s", shed=True), shed.clock, 10, True)
    assert shed.session.detached and shed.session.reattach.hold_until is None and len(shed.queue) == 1


def test_a_lost_draft_detaches_and_a_returned_one_takes_the_session_up_again():
    h = Harness()
    h.start()
    h.draft.available = False
    h.do.detach(cancel=False)
    assert h.session.mode is DraftMode.DETACHED and h.session.epoch == 1
    (block, _), = h.queue
    assert len(block.tokens) == 0
    h.draft.available = True
    h.do.attach()  # the verdict in flight is decided first
    h.verify(0, 15)
    start = h.draft.last("start")
    assert h.draft.count("start") == 2 and list(start.prompt_ids) == [*PROMPT, 15] and start.epoch == h.session.epoch
    assert start.max_new_tokens == 19 and h.session.mode is DraftMode.DRAFTING
    h.deliver(h.block([16]))
    assert len(h.queue) == 1


def test_the_budget_and_a_stop_token_end_the_session_with_a_finished_event():
    h = Harness(max_new_tokens=3)
    h.start()
    h.deliver(h.block([11, 12]))
    h.verify(2, 13)
    assert h.finish_reason == "length" and h.session.done and h.session.target.closed
    h2 = Harness()
    h2.start()
    h2.deliver(h2.block([11, STOP, 12]))
    h2.verify(3, 14)
    assert h2.tokens == [11, STOP] and h2.finish_reason == "stop"


def test_without_a_draft_the_target_settles_one_token_per_round():
    h = Harness(draft=False)
    h.start()
    for token in (21, 22):
        (block, (_, source)), = h.queue
        assert len(block.tokens) == 0 and source == "none"
        h.verify(0, token)
    assert h.tokens == [21, 22] and h.draft.sent == []


def test_a_paused_session_detaches_from_the_pause_and_pauses_again_on_re_attach():
    """The draft mode is one state: a lost draft ends a pause (the tokens settled alone are not
    owed to a Resume any more), and the re-attach's start carries the cap that pauses it again."""
    cap = [0]
    h = Harness(load_cap=lambda gate: cap[0])
    h.start()
    assert h.session.mode is DraftMode.PAUSED and h.draft.last("start").load_cap == 0
    h.verify(0, 15)  # the target settles alone while paused
    assert h.session.mode is DraftMode.PAUSED and h.tokens == [15]
    h.draft.available = False
    h.do.detach(cancel=False)
    assert h.session.mode is DraftMode.DETACHED and not h.session.paused
    h.draft.available = True
    h.do.attach()  # the verdict in flight first
    h.verify(0, 16)
    assert h.draft.count("start") == 2 and h.session.mode is DraftMode.PAUSED
    cap[0] = 4
    h.verify(0, 17)  # drafting pays again: a Resume with the tokens settled since the pause
    resume = h.draft.last("resume")
    assert h.session.mode is DraftMode.DRAFTING and list(resume.tokens) == [17] and resume.load_cap == 4


# --- the target never idles for a block: its own tokens while it waits (fill) ----------------------


def test_a_waiting_session_settles_the_targets_own_tokens_and_the_block_is_verified_after_them():
    h = Harness()
    h.start()
    h.fill(11, 12)
    assert h.tokens == [11, 12] and h.draft.count("feedback") == 0 and h.session.draft_base == 3
    assert h.session.stats.round_sources == ["filled", "filled"]
    h.deliver(h.block([11, 12, 13, 14]))  # drafted on the prompt: its first two are the target's own
    (block, _), = h.queue
    checked = h.checked[0]
    assert block.base == 3 and (checked.base, list(checked.tokens)) == (5, [13, 14])
    assert h.target.judged == 2  # the two the target settled alone; the verifier counts the rest
    h.verify(1, 20)  # of what followed the target's own tokens: 13 accepted, 20 settles the next place
    fb = h.draft.last("feedback")
    assert (fb.base, fb.drafted, fb.accepted, fb.token, fb.epoch) == (3, 4, 3, 20, 1)  # on the block it sent
    assert h.tokens == [11, 12, 13, 20] and h.session.draft_base == 7 and h.session.stats.accepted_lengths[-1] == 3


def test_a_block_that_parts_from_the_targets_own_tokens_is_decided_by_them_with_no_forward():
    h = Harness()
    h.start()
    h.fill(11, 12, 13)
    h.deliver(h.block([11, 30, 31]))
    assert h.queue == [] and h.tokens == [11, 12, 13] and h.target.judged == 3  # nothing settled twice
    fb = h.draft.last("feedback")
    assert (fb.base, fb.drafted, fb.accepted, fb.token, fb.epoch) == (3, 3, 1, 12, 1)  # as a verification says
    assert h.session.draft_base == 5 and h.session.waiting_since is not None
    h.deliver(h.block([13, 40]))  # the draft's next block, from its correction: checked against 13
    assert (h.checked[0].base, list(h.checked[0].tokens)) == (6, [40])
    h.verify(1, 41)
    assert h.tokens == [11, 12, 13, 40, 41]


def test_a_block_within_the_targets_own_tokens_is_accepted_whole_and_settles_nothing_new():
    h = Harness()
    h.start()
    h.fill(11, 12, 13)
    h.deliver(h.block([11, 12]))
    fb = h.draft.last("feedback")
    assert h.queue == [] and (fb.accepted, fb.token) == (2, 13) and h.tokens == [11, 12, 13]
    h.deliver(h.block([]))  # the draft has nothing to draft: the empty block asks for the next place
    (block, (_, source)), = h.queue
    assert h.checked[0].base == 6 and len(h.checked[0].tokens) == 0
    h.verify(0, 14)
    assert h.tokens == [11, 12, 13, 14] and h.draft.last("feedback").token == 14


def test_a_follow_up_is_checked_against_the_targets_own_tokens_too():
    """Async: a full acceptance defers the next place to the follow-up; while that is late the
    target settles it from the row the verification stored, and the follow-up is checked against it."""
    h = Harness(pipeline="async")
    h.start()
    h.deliver(h.block([11, 12], followup=True))
    h.verify(2, NO_TOKEN)
    assert h.draft.last("feedback").token == NO_TOKEN and h.session.draft_base == 5
    h.fill(13, 14)  # the follow-up is late
    h.deliver(h.block([13, 45, 46], base=5))
    fb = h.draft.last("feedback")
    assert h.queue == [] and (fb.base, fb.accepted, fb.token) == (5, 1, 14) and h.tokens == [11, 12, 13, 14]


def test_a_block_at_the_targets_own_place_and_not_the_drafts_is_a_bad_block(caplog):
    h = Harness()
    h.start()
    h.fill(11)
    h.deliver(h.block([12, 13], base=4))  # the draft never learnt 11: it cannot draft after it
    assert h.session.mode is DraftMode.GIVEN_UP and "base 4, committed 3" in caplog.text
    assert h.tokens == [11]


def test_a_pause_hands_the_targets_own_tokens_to_the_draft_with_the_resume():
    cap = [4]
    h = Harness(load_cap=lambda gate: cap[0])
    h.start()
    h.fill(11, 12, 13)
    cap[0] = 0
    h.deliver(h.block([11, 30]))  # decided by the target's own tokens: 12 is the correction; and it pauses
    assert h.session.mode is DraftMode.PAUSED and h.draft.last("feedback").load_cap == 0
    (block, (_, source)), = h.queue
    assert source == "paused" and block.base == 6
    cap[0] = 4
    h.verify(0, 14)
    resume = h.draft.last("resume")
    assert (resume.base, list(resume.tokens)) == (5, [13, 14]) and h.session.draft_base == 7


def test_only_a_greedy_session_waiting_on_its_draft_fills():
    sampled = Harness(sampling=SamplingParams(temperature=0.8, seed=1))
    sampled.start()
    assert not sampled.session.wants_fill()
    h = Harness()
    h.start()
    assert h.session.wants_fill() and not h.do.fill(1.0, 1.0)  # no row stored: nothing settled
    h.deliver(h.block([11]))
    assert not h.session.wants_fill()  # verifying
    h.verify(1, 12)
    assert h.session.wants_fill()
    h.fill(STOP)  # the target's own stop token ends the output like any other
    assert h.finish_reason == "stop" and not h.session.wants_fill() and h.draft.count("cancel") == 1


# --- the core's shape: events in, effects out, no clock ------------------------------------------------


def test_a_round_is_its_effects_in_order_and_the_same_events_at_the_same_times_give_the_same_effects():
    """The session reads no clock and calls nothing of its transport: what a round does is the
    list each event returns, in order (a verify is asked for, not run; the feedback leaves once
    the verdict's next round is known, so a follow-up decided at once joins it), and two sessions
    fed the same events at the same times return equal effects, timestamps included."""
    runs = []
    for _ in range(2):
        h = Harness(pipeline="async")
        effects = h.start()
        effects += h.do.on_draft_event(h.block([11, 12, 13]), 5.0, 100, True)
        block, (received_at, source) = h.queue[0]
        effects += h.do.verified(block, Verdict(block.base, 1, 20), received_at, source, 6.0, 7.0)
        runs.append(effects)
    assert runs[0] == runs[1]
    kinds = [type(effect).__name__ for effect in runs[0]]
    assert kinds == ["ToDraft", "Verify", "Settle", "ToDraft"]  # start; the block; then the verdict's
    assert runs[0][2] == Settle((11, 20))
    feedback = runs[0][3].request
    assert isinstance(feedback, Feedback) and feedback.sent_at == h.clock  # the event's time, not a clock's


def test_an_event_never_runs_inside_another():
    """A rule that needs another event's work calls its private body: an event started within
    one would interleave two lists of effects."""
    h = Harness()
    h.session._start_draft = lambda: h.session.attach(h.clock)
    with pytest.raises(RuntimeError, match="attach called within another event"):
        h.start()
    assert h.session._effects is None  # the failed event left no half-collected effects behind


def test_a_follow_up_grows_while_it_is_held_and_is_verified_as_it_stands():
    """growth.py: more tokens of the held follow-up are appended to it; its predecessor's feedback
    says how many go on (next_tokens), and what arrives after that is dropped unverified."""
    h = Harness(pipeline="async")
    h.start()
    h.deliver(h.block([11, 12], followup=True))
    h.deliver(h.block([13], base=5, followup=True))  # the follow-up, sent at its first stop
    h.deliver(h.block([14, 15], base=5, followup=True, grows=1))
    held = h.session.ahead.followup[0]
    assert held.tokens == [13, 14, 15] and held.block.entropies == [0.3] * 3
    h.verify(2, NO_TOKEN)
    fb = h.draft.last("feedback")
    assert fb.outcome.next_tokens == 3 and [b.tokens for b, _ in h.queue] == [[13, 14, 15]]
    h.deliver(h.block([16], base=5, followup=True, grows=3))  # too late: the follow-up is being verified
    assert h.queue[0][0].tokens == [13, 14, 15] and h.session.stats.discarded_tokens == 1
    h.verify(2, 40)
    assert h.tokens == [11, 12, 13, 14, 40]


def test_a_growth_that_does_not_continue_the_held_follow_up_is_dropped():
    h = Harness(pipeline="async")
    h.start()
    h.deliver(h.block([11, 12], followup=True))
    h.deliver(h.block([13], base=5, followup=True))
    h.deliver(h.block([14], base=5, grows=2))  # the draft says it held two: not the one held here
    h.deliver(h.block([14], base=6, grows=1))  # another base
    assert h.session.ahead.followup[0].tokens == [13] and h.session.stats.discarded_tokens == 2
    h.verify(2, NO_TOKEN)
    assert h.draft.last("feedback").outcome.next_tokens == 1


def test_a_prepared_continuation_grows_while_it_is_held_and_is_verified_as_it_stands():
    """stepping.py's _sent_now: a continuation sent before it ended grows by its rest; the verdict
    that uses it says how many of its tokens the target verifies (next_tokens)."""
    h = Harness(pipeline="async")
    h.start()
    h.deliver(h.block([11, 12, 13]))
    h.deliver(h.block([21, 22], base=5, prepared_for=(3, 1, 20)))  # sent as it stood
    h.deliver(h.block([23, 24], base=5, prepared_for=(3, 1, 20), grows=2))  # the rest, once it ended
    h.deliver(h.block([29], base=5, prepared_for=(3, 1, 20), grows=3))  # not what is held: dropped
    assert h.session.ahead.prepared[(3, 1, 20)][0].tokens == [21, 22, 23, 24]
    assert h.session.stats.discarded_tokens == 1
    h.verify(1, 20)
    fb = h.draft.last("feedback")
    assert fb.prepared_used and fb.outcome.next_tokens == 4
    assert [list(b.tokens) for b, _ in h.queue] == [[21, 22, 23, 24]]


@pytest.mark.parametrize("fields, sampling", [
    ({"prepared_for": (3, 0, 20)}, SamplingParams(temperature=0.8, seed=1)),
    ({}, SamplingParams(temperature=0.8, seed=1)),
])
def test_a_growth_of_anything_but_a_greedy_chain_gives_the_draft_up(fields, sampling, caplog):
    h = Harness(pipeline="async", sampling=sampling)
    h.start()
    first = h.block([11, 12], followup=True)
    first.block.probs = [0.5, 0.5]  # a sampled block carries q(d)
    h.deliver(first)
    assert h.session.mode is DraftMode.DRAFTING and len(h.queue) == 1
    more = h.block([13], base=5, grows=1, **fields)
    more.block.probs = [0.5]
    h.deliver(more)
    assert h.session.mode is DraftMode.GIVEN_UP


def tree_block(h: Harness, tokens: list[int], siblings: list[list[int]] | None, **fields) -> DraftedBlock:
    item = h.block(tokens, **fields)
    item.block.siblings = siblings
    return item


def test_a_flat_trees_growth_brings_its_places_siblings():
    """A flat tree's follow-up grows as a chain's does; each place comes with its siblings, and a
    part whose places kept none (a chain on the wire) counts none at each."""
    h = Harness(pipeline="async", tree="cape")
    h.start()
    h.deliver(h.block([11, 12], followup=True))
    h.deliver(h.block([13], base=5, followup=True))  # no sibling kept: sent as a chain
    h.deliver(tree_block(h, [14, 15], [[], [31, 32]], base=5, followup=True, grows=1))
    h.deliver(h.block([16], base=5, followup=True, grows=3))
    held = h.session.ahead.followup[0].block
    assert held.tokens == [13, 14, 15, 16] and held.siblings == [[], [], [31, 32], []]
    h.verify(2, NO_TOKEN)
    assert h.draft.last("feedback").outcome.next_tokens == 4
    assert [(b.tokens, b.block.siblings) for b, _ in h.queue] == [([13, 14, 15, 16], [[], [], [31, 32], []])]


@pytest.mark.parametrize("tree, siblings, why", [
    ("off", [[31]], "token tree for a session that drafts chains"),  # a chain's session
    ("deep", [[31]], "other than a greedy chain or flat tree"),  # its grown nodes follow the spine
    ("deep", None, "other than a greedy chain or flat tree"),
    ("cape", [[14]], "repeat a token there"),  # a sibling equal to its place's token
    ("cape", [[31, 31]], "repeat a token there"),
    ("cape", [[1 << 20]], "sibling token id"),  # out of the vocabulary
])
def test_a_tree_growth_that_is_not_a_flat_trees_well_formed_places_gives_the_draft_up(tree, siblings, why, caplog):
    h = Harness(pipeline="async", tree=tree)
    h.start()
    h.deliver(h.block([11, 12], followup=True))
    h.deliver(h.block([13], base=5, followup=True))
    h.deliver(tree_block(h, [14], siblings, base=5, followup=True, grows=1))
    assert h.session.mode is DraftMode.GIVEN_UP and why in caplog.text


def test_a_tree_growth_past_the_node_cap_with_what_is_held_gives_the_draft_up(caplog):
    h = Harness(pipeline="async", tree="cape")
    h.start()
    h.deliver(h.block([11, 12], followup=True))
    h.deliver(tree_block(h, [13], [[t for t in range(50) if t != 13][:40]], base=5, followup=True))  # 41 nodes held
    h.deliver(tree_block(h, [14], [[t for t in range(50) if t != 14][:30]], base=5, followup=True, grows=1))  # 31 more
    assert h.session.mode is DraftMode.GIVEN_UP and "grew a tree of 41 nodes by 31; the cap is 64" in caplog.text


def test_a_growth_past_the_cap_gives_the_draft_up():
    h = Harness(pipeline="async")
    h.start()
    h.deliver(h.block([11, 12], followup=True))
    h.deliver(h.block([13], base=5, followup=True))
    h.deliver(h.block([14] * LIMITS.max_draft_length, base=5, grows=1))
    assert h.session.mode is DraftMode.GIVEN_UP
