"""The draft side's protocol state machine (draft_worker/pipelined.py), without a model: a
scripted draft proposes a known token sequence, and each test drives PipelinedDraft through the
messages the target sends (start, feedback, resume) and checks what it sends back and what it
then knows. The same protocol runs end to end with real models in tests/integration; here each
transition is pinned down on its own, fast.

Times: every feedback says it arrived an hour after the block left, so the draft's estimate of
when a verdict is due never stops it preparing (no test depends on how fast this machine is)."""

from __future__ import annotations

import math
import time

import pytest

from draft_worker.pipelined import PipelinedDraft
from draft_worker.stepping import work
from svip_common.contracts import NO_TOKEN, Block, SamplingParams
from svip_common.errors import InvalidRequest
from tests.verdicts import apply_verdict

VOCAB = 50
STOP = 0
PROMPT = [7, 8, 9]
LATE = 3600.0  # a verdict arrives this long after "now": preparing always has time


def model(seq: list[int]) -> int:
    """The scripted draft's choice after seq (never the stop token unless seq asks for it)."""
    return 1 + (seq[-1] * 3 + 1) % (VOCAB - 1)


def runner_up(token: int) -> int:
    return 1 + token % (VOCAB - 1)


class ScriptedBlock:
    """A BlockDraft stand-in: `length` tokens of the script (or fewer: budget, stop token), each
    with q = 0.9 and one runner-up at q = 0.08."""

    cache = None  # drafted on its session's own cache (no fork)
    error = None  # its own work never fails

    def __init__(self, seq: list[int], budget: int, length: int, stop_ids: frozenset[int]):
        self.block = Block(base=len(seq), tokens=[], probs=[], entropies=[])
        self.alternatives: list[list[tuple[int, float]]] = []
        self.compute_s = self.prefill_s = 0.0
        self._seq, self._limit, self._stop_ids = list(seq), min(length, budget), stop_ids
        self.done = self._limit <= 0

    def step(self) -> bool:
        token = model(self._seq)
        self._seq.append(token)
        self.block.tokens.append(token)
        self.block.probs.append(0.9)
        self.block.entropies.append(0.3)
        self.alternatives.append([(runner_up(token), 0.08)])
        self.done = len(self.block) >= self._limit or token in self._stop_ids
        return self.done

    @property
    def reach(self) -> float:
        """BlockDraft's: the draft's chance that the block holds up to its last token."""
        return math.prod(self.block.probs)


class ScriptedDrafter:
    """A Drafter stand-in: a step advances each block by its script's next token."""

    @staticmethod
    def step(blocks) -> None:
        for block in blocks:
            block.step()


class ScriptedSession:
    """A DraftSession stand-in: blocks of `length`, and a record of the verdicts it was told."""

    _drafter = ScriptedDrafter()
    sampling = SamplingParams()  # greedy
    tree = "off"  # chains, as DraftSession's default
    forward_price = 0.0  # DraftSession's: no deep tree prices its own forward
    node_price = 0.0  # DraftSession's until the target sends one: a verified node is free

    def __init__(self, length: int = 3, stop_ids: frozenset[int] = frozenset({STOP})):
        self.length, self.stop_ids = length, stop_ids
        self.verdicts: list[tuple[int, int]] = []
        self.begun: list[tuple[tuple[int, ...], int]] = []
        self.closed = False
        self.cached_tokens = 0
        self.features: list = []  # (features, first) as a feature draft takes them in

    def begin(self, seq, budget: int, alternatives: bool = False, fork: bool = False) -> ScriptedBlock:
        self.begun.append((tuple(seq), budget))
        return ScriptedBlock(list(seq), budget, self.length, self.stop_ids)

    def feedback(self, drafted: int, accepted: int) -> None:
        self.verdicts.append((drafted, accepted))

    def take_features(self, features, first: int) -> None:
        self.features.append((features, first))

    def close(self) -> None:
        self.closed = True


def session(pipelined: bool = False, max_new_tokens: int = 20, length: int = 3, prepare: int = 2) -> PipelinedDraft:
    return PipelinedDraft(ScriptedSession(length), list(PROMPT), max_new_tokens, frozenset({STOP}), pipelined,
                          prepare=prepare)


def script(seq: list[int], n: int) -> list[int]:
    out, seq = [], list(seq)
    for _ in range(n):
        seq.append(model(seq))
        out.append(seq[-1])
    return out


def drain(s: PipelinedDraft, steps: int = 100) -> list:
    """Run the session's forwards until it has nothing to do; every block it sends, in order."""
    sent = []
    for _ in range(steps):
        out = work(s, time.time())
        if out is None:
            return sent
        sent += out
    raise AssertionError("the session kept working")


def feedback(s: PipelinedDraft, block: Block, accepted: int, token: int, **kw):
    return apply_verdict(s, time.time(), block.epoch, block.base, len(block), accepted, token, None,
                         kw.pop("prepared_used", False), time.time() + LATE, **kw)


def test_sync_drafts_a_block_then_waits_for_its_verdict():
    s = session()
    assert s.start(time.time()) == []  # the first block is a job for the batched steps
    (item,) = drain(s)
    assert item.block.base == len(PROMPT) and item.block.tokens == script(PROMPT, 3)
    assert not item.followup and s.next_drafts(time.time()) == []  # sync: nothing ahead of the verdict


def test_a_full_acceptance_and_its_bonus_token_start_the_next_block_there():
    s = session()
    s.start(time.time())
    (first,) = drain(s)
    bonus = 42
    assert feedback(s, first.block, 3, bonus) == []
    assert s.known == PROMPT + first.block.tokens + [bonus] and s.session.verdicts == [(3, 3)]
    (second,) = drain(s)
    assert second.block.base == len(PROMPT) + 4 and second.block.tokens == script(s.known, 3)


def test_a_rejection_rolls_back_to_the_correction_in_the_new_epoch():
    s = session()
    s.start(time.time())
    (first,) = drain(s)
    correction = runner_up(first.block.tokens[1])
    assert apply_verdict(s, time.time(), 5, first.block.base, 3, 1, correction, None, False, time.time()) == []
    assert s.known == PROMPT + first.block.tokens[:1] + [correction] and s.epoch == 5
    (second,) = drain(s)
    assert second.block.epoch == 5 and second.block.base == len(s.known)
    assert s.session.begun[-1][0] == tuple(s.known)  # drafted from the corrected sequence


def test_a_branch_settles_the_sibling_and_the_token_after_it():
    """A tree's verdict that takes a sibling at the rejected place: the draft knows the sibling and
    the target's token after it, and drafts on from there; a branch it never drafted is refused."""
    s = session()
    s.start(time.time())
    (first,) = drain(s)
    first.block.siblings = [[], [runner_up(first.block.tokens[1])], []]
    with pytest.raises(InvalidRequest, match="not a sibling"):
        feedback(s, first.block, 1, 42, branch=(runner_up(first.block.tokens[0]),))
    sibling = first.block.siblings[1][0]
    assert feedback(s, first.block, 1, 42, branch=(sibling,)) == []
    assert s.known == PROMPT + first.block.tokens[:1] + [sibling, 42] and s.session.verdicts == [(3, 1)]
    (second,) = drain(s)
    assert second.block.base == len(PROMPT) + 3 and s.session.begun[-1][0] == tuple(s.known)


def test_a_deep_branch_settles_the_sibling_its_grown_child_and_the_token_after_them():
    """A deep tree's verdict takes a sibling and the child grown below it: the draft knows both
    and the target's token after them; a child it never grew there is refused."""
    s = session()
    s.start(time.time())
    (first,) = drain(s)
    sibling = runner_up(first.block.tokens[1])
    first.block.siblings = [[], [sibling], []]
    first.block.grown = [(3, 77)]  # node 3 is the sibling
    with pytest.raises(InvalidRequest, match="78 at place 2, not a node this session grew there"):
        feedback(s, first.block, 1, 42, branch=(sibling, 78))
    assert feedback(s, first.block, 1, 42, branch=(sibling, 77)) == []
    assert s.known == PROMPT + first.block.tokens[:1] + [sibling, 77, 42]
    (second,) = drain(s)
    assert second.block.base == len(PROMPT) + 4 and s.session.begun[-1][0] == tuple(s.known)


def test_a_deep_trees_own_forward_is_priced_at_the_tokens_a_second_the_session_settles():
    """Each verdict prices a draft forward of a deep tree's own (trees.forward_price) for the blocks
    drafted after it: the tokens settled since the first verdict over the time since, times a
    forward's learnt time; nothing is settled yet at the first (free). A session of another tree
    keeps no price."""
    s = session()
    s.session.tree = "deep-auto"
    s.start(0.0)
    (first,) = drain(s)
    s.timing.forward_s.update(0.01)
    apply_verdict(s, 10.0, first.block.epoch, first.block.base, 3, 3, 42, None, False, 10.0)
    assert s.session.forward_price == 0.0
    (second,) = drain(s)
    s.timing.forward_s.update(0.01)
    apply_verdict(s, 12.0, second.block.epoch, second.block.base, 3, 1, 43, None, False, 12.0)
    # the first verdict settled 4 tokens (3 and its bonus) in the 2 s since: 2 a second
    assert s.session.forward_price == pytest.approx(2.0 * s.timing.forward_s.value)
    assert s.known == PROMPT + first.block.tokens + [42] + second.block.tokens[:1] + [43]
    chains = session()
    chains.start(0.0)
    (first,) = drain(chains)
    chains.timing.forward_s.update(0.01)
    apply_verdict(chains, 10.0, first.block.epoch, first.block.base, 3, 3, 42, None, False, 10.0)
    (second,) = drain(chains)
    apply_verdict(chains, 12.0, second.block.epoch, second.block.base, 3, 1, 43, None, False, 12.0)
    assert chains.session.forward_price == 0.0 and chains.rate_since is None


@pytest.mark.parametrize("base, drafted, accepted, message", [
    (len(PROMPT) + 1, 3, 1, "did not send"),
    (len(PROMPT), 2, 1, "did not send"),
    (len(PROMPT), 3, 4, "accepts 4 of 3"),
])
def test_feedback_on_a_block_it_did_not_send_is_refused(base, drafted, accepted, message):
    s = session()
    s.start(time.time())
    drain(s)
    with pytest.raises(InvalidRequest, match=message):
        apply_verdict(s, time.time(), 0, base, drafted, accepted, 5, None, False, time.time())


def test_a_pause_drafts_nothing_until_a_resume_brings_the_targets_tokens():
    s = session()
    s.start(time.time())
    (first,) = drain(s)
    assert feedback(s, first.block, 3, 42, load_cap=0) == []
    assert s.paused and s.next_drafts(time.time()) == [] and drain(s) == []
    with pytest.raises(InvalidRequest, match="base"):
        s.on_resume(time.time(), 1, len(s.known) + 1, [5], 4, time.time())
    with pytest.raises(InvalidRequest, match="load_cap 0"):
        s.on_resume(time.time(), 1, len(s.known), [5], 0, time.time())
    alone = [11, 12]  # what the target settled alone meanwhile
    assert s.on_resume(time.time(), 1, len(s.known), alone, 2, time.time()) == []
    assert not s.paused and s.known[-2:] == alone
    (item,) = drain(s)
    assert item.block.epoch == 1 and len(item.block) == 2  # the resume's cap holds
    with pytest.raises(InvalidRequest, match="not paused"):
        s.on_resume(time.time(), 2, len(s.known), [], 2, time.time())


def test_a_session_that_starts_paused_drafts_nothing():
    s = session()
    assert s.start(time.time(), load_cap=0) == [] and s.paused and drain(s) == []


def test_the_budget_ends_the_output_with_an_empty_block_for_the_last_place():
    s = session(max_new_tokens=4)
    s.start(time.time())
    (first,) = drain(s)
    out = feedback(s, first.block, 3, 42)  # 4 tokens settled: the budget is spent
    assert out == [] and len(s.known) == len(PROMPT) + 4 and s.next_drafts(time.time()) == []
    s2 = session(max_new_tokens=5)
    s2.start(time.time())
    (first,) = drain(s2)
    (empty,) = feedback(s2, first.block, 3, 42)  # one place left, the verdict's own token fills it
    assert empty.block.tokens == [] and empty.block.base == len(PROMPT) + 4


def test_one_block_at_a_time_a_follow_up_drafts_past_its_stop_only_where_no_continuation_waits():
    """A session that drafts one block at a time (no forks: ``parallel`` 1, a feature head) leaves
    the follow-up's place to the continuations waiting for it at the follow-up's stop; one that
    drafts them side by side on forks lets it draft on while the verdict is not due."""
    s = session(pipelined=True)
    s.start(time.time())
    while not s.outstanding:  # the first block, drafted and sent
        work(s, time.time())
    if not s.jobs:
        s.next_drafts(time.time())  # the follow-up begins
    job = s.jobs[0]
    assert job.followup and s.agenda  # continuations wait for its place
    assert not job.draft.extends()
    s.parallel, s.session.can_fork = 2, True  # side by side: the continuations have places of their own
    assert job.draft.extends()
    s.parallel, s.agenda = 1, []  # one at a time, nothing waiting
    assert job.draft.extends()


def test_async_sends_the_follow_up_and_prepared_continuations_while_a_block_is_verified():
    s = session(pipelined=True)
    s.start(time.time())
    sent = drain(s)
    first, followup = sent[0], sent[1]
    assert first.followup and first.prepared_for is None
    assert followup.block.base == first.block.base + 3
    assert followup.block.tokens == script(PROMPT + first.block.tokens, 3)
    prepared = [o for o in sent if o.prepared_for is not None]
    keys = {o.prepared_for for o in prepared}
    # the two most likely rejections of each outstanding block: its first two places, the runner-up there
    for block in (first.block, followup.block):
        for j in (0, 1):
            assert (block.base, j, runner_up(block.tokens[j])) in keys
    for o in prepared:
        base, j, token = o.prepared_for
        sequence = PROMPT + first.block.tokens + followup.block.tokens
        assert o.block.base == base + j + 1 and o.block.tokens == script(sequence[:base + j] + [token], 3)


def test_a_deferred_acceptance_makes_the_follow_up_the_block_in_flight():
    s = session(pipelined=True)
    s.start(time.time())
    sent = drain(s)
    first, followup = sent[0], sent[1]
    assert feedback(s, first.block, 3, NO_TOKEN) == []  # whole, and the follow-up settles what is next
    assert s.known == PROMPT + first.block.tokens and s.outstanding[0] is followup
    assert all(key[0] != first.block.base for key in s.prepared.blocks)  # the first block's continuations are void


def test_a_used_prepared_continuation_is_the_next_block_without_drafting_again():
    s = session(pipelined=True)
    s.start(time.time())
    sent = drain(s)
    first = sent[0]
    key = (first.block.base, 1, runner_up(first.block.tokens[1]))
    ready = next(o for o in sent if o.prepared_for == key)
    begun = len(s.session.begun)
    out = apply_verdict(s, time.time(), 3, first.block.base, 3, 1, key[2], None, True, time.time() + LATE)
    assert out == [] and s.outstanding == [ready] and ready.block.epoch == 3
    assert s.known == PROMPT + first.block.tokens[:1] + [key[2]]
    assert len(s.session.begun) == begun  # nothing drafted for it: it was ready
    with pytest.raises(InvalidRequest, match="did not send"):
        apply_verdict(s, time.time(), 3, first.block.base, 3, 1, key[2], None, True, time.time())


def prepared_after_a_sibling():
    """An async session's first block, made a tree with one sibling at its second place (the
    runner-up a continuation was prepared after), and that continuation: (session, block, sibling,
    continuation)."""
    s = session(pipelined=True)
    s.start(time.time())
    sent = drain(s)
    first = sent[0]
    sibling = runner_up(first.block.tokens[1])
    first.block.siblings = [[], [sibling], []]
    return s, first, sibling, next(o for o in sent if o.prepared_for == (first.block.base, 1, sibling))


def test_a_continuation_prepared_after_a_sibling_follows_the_branch_that_takes_it():
    """A tree's verdict takes the sibling a continuation was prepared after: that continuation is
    the block in flight, its first place the token the target settled after the sibling (so the
    draft does not know that token yet); unused, and the target's token there another than its
    first, it is dropped (the target's next block starts past that token), never sent again."""
    for used in (True, False):
        s, first, sibling, ready = prepared_after_a_sibling()
        assert ready.block.tokens[0] != 42
        out = apply_verdict(s, time.time(), 3, first.block.base, 3, 1, 42, None, used, time.time() + LATE,
                            branch=(sibling,))
        assert out == []
        if used:
            assert s.outstanding == [ready] and s.known == PROMPT + first.block.tokens[:1] + [sibling]
        else:
            assert s.outstanding == [] and s.known == PROMPT + first.block.tokens[:1] + [sibling, 42]
            assert s.critical is not None and s.critical.draft.block.base == len(s.known)


@pytest.mark.parametrize("holds", ["more", "only that token", "another token"])
def test_a_continuation_prepared_after_a_sibling_goes_on_past_the_token_settled_after_it(holds):
    """Issue 60: the verdict takes the sibling and settles the place after it at the target (the
    continuation came late, or was not used). Where the continuation drafted that very token, the
    rest of it is the next block, sent now in the new epoch: nothing is drafted again. Where it
    holds nothing past that token, or drafted another there, the draft begins afresh past it."""
    s, first, sibling, ready = prepared_after_a_sibling()
    drafted = list(ready.block.tokens)
    settled = runner_up(drafted[0]) if holds == "another token" else drafted[0]
    if holds == "only that token":
        del ready.block.tokens[1:], ready.block.probs[1:], ready.block.entropies[1:]
    begun = len(s.session.begun)
    out = apply_verdict(s, time.time(), 3, first.block.base, 3, 1, settled, None, False, time.time() + LATE,
                        branch=(sibling,))
    assert s.known == PROMPT + first.block.tokens[:1] + [sibling, settled]
    if holds != "more":
        assert out == [] and s.outstanding == [] and s.critical.draft.block.base == len(s.known)
        assert s.session.begun[begun:] == [(tuple(s.known), 20 + len(PROMPT) - len(s.known) - 1)]
        return
    (rest,) = out
    assert rest.block.base == len(s.known) and rest.block.tokens == drafted[1:] and rest.block.epoch == 3
    assert rest.alternatives == ready.alternatives[1:] and rest.reused and rest.prepared_for is None
    assert s.outstanding == [rest] and len(s.session.begun) == begun


def test_a_continuation_prepared_after_a_sibling_serves_a_deep_branch_that_begins_it():
    """A deep tree's verdict takes a sibling and the child grown below it: the continuation
    prepared after that sibling begins with the child (both are the draft's choice after it), so
    the target may verify it next. The draft then knows the path up to the sibling: the
    continuation's own verdict settles the child and the token after it. One that does not begin
    with the child cannot be used."""
    for child_fits in (True, False):
        s, first, sibling, ready = prepared_after_a_sibling()
        child = ready.block.tokens[0] if child_fits else runner_up(ready.block.tokens[0])
        first.block.grown = [(3, child)]  # node 3: the sibling, after the spine's three
        branch = (sibling, child)
        if not child_fits:
            with pytest.raises(InvalidRequest, match="does not begin"):
                apply_verdict(s, time.time(), 3, first.block.base, 3, 1, 42, None, True, time.time() + LATE,
                              branch=branch)
            continue
        out = apply_verdict(s, time.time(), 3, first.block.base, 3, 1, 42, None, True, time.time() + LATE,
                            branch=branch)
        assert out == [] and s.outstanding == [ready] and ready.block.epoch == 3
        assert s.known == PROMPT + first.block.tokens[:1] + [sibling] and ready.block.base == len(s.known)


def test_a_prepared_continuation_it_never_made_cannot_be_used():
    s = session(pipelined=True, prepare=0)
    s.start(time.time())
    first = drain(s)[0]
    with pytest.raises(InvalidRequest, match="prepared continuation"):
        apply_verdict(s, time.time(), 1, first.block.base, 3, 0, 33, None, True, time.time())


def test_a_pause_must_settle_its_token_at_the_target():
    s = session(pipelined=True)
    s.start(time.time())
    first = drain(s)[0]
    with pytest.raises(InvalidRequest, match="pause"):
        feedback(s, first.block, 3, NO_TOKEN, load_cap=0)


def test_a_sampled_rejection_without_the_targets_row_is_refused():
    s = session()
    s.start(time.time())
    first = drain(s)[0]
    with pytest.raises(InvalidRequest, match="p row"):
        feedback(s, first.block, 1, NO_TOKEN)


def test_close_drops_every_job_and_returns_the_pages():
    s = session(pipelined=True)
    s.start(time.time())
    work(s, time.time())
    s.close()
    assert s.session.closed and s.jobs == [] and s.critical is None and s.prepared.blocks == {}


def _timing_after(fresh: list[bool]):
    """A VerdictTiming that learnt a 10 s wait for each verdict, 2 s forwards, and these verdicts
    (True: one that needed a block drafted afresh); with a block outstanding since time 0."""
    from draft_worker.line_state import VerdictTiming
    from svip_common.messages import DraftedBlock

    timing = VerdictTiming()
    timing.verdict_wait.update(10.0)
    timing.forward_s.update(2.0)
    for each in fresh:
        timing.learn_fresh(each)
    block = DraftedBlock(Block(base=3, tokens=[1], probs=[0.9], entropies=[0.1]), True, finished_at=0.0)
    return timing, [block]


def test_a_forward_that_would_outlast_the_verdict_starts_only_when_verdicts_seldom_need_a_fresh_block():
    """Issue 60: a forward still running at the verdict delays only a block drafted afresh; it is
    priced at its time times the share of verdicts that needed one."""
    timing, outstanding = _timing_after([])
    assert timing.room_for_a_forward(7.9, outstanding) and not timing.room_for_a_forward(8.1, outstanding)
    timing, outstanding = _timing_after([True] * 20)  # every verdict needs a fresh block: none may outlast it
    assert not timing.room_for_a_forward(8.1, outstanding)
    timing, outstanding = _timing_after([False] * 40)  # none does: a forward may start until the verdict is due
    assert timing.room_for_a_forward(9.9, outstanding) and not timing.room_for_a_forward(10.0, outstanding)
    timing, outstanding = _timing_after([False, True] * 20)  # about half: it ends within half a forward of it
    assert timing.room_for_a_forward(8.8, outstanding) and not timing.room_for_a_forward(9.0, outstanding)


def test_what_a_verdict_needed_is_learnt_from_its_outcome():
    s = session(pipelined=True)
    s.start(time.time())
    first, followup = drain(s)[:2]
    assert feedback(s, first.block, 3, NO_TOKEN) == []  # whole: the follow-up goes on
    assert s.timing.fresh.value == 0.0
    drain(s)
    token = next(t for t in range(1, VOCAB) if (followup.block.base, 0, t) not in s.prepared
                 and t != followup.block.tokens[0])
    assert feedback(s, followup.block, 0, token) == []  # nothing prepared for it: a block afresh
    assert s.timing.fresh.value == pytest.approx(0.2) and s.critical is not None


def test_a_continuation_less_likely_than_a_rows_share_of_the_step_is_not_prepared():
    """The worker prices a row of its step (row_price): the scripted runner-ups (q 0.08) are
    prepared when a row costs less than that chance, and not when it costs more."""
    for price, prepared in ((0.05, True), (0.1, False)):
        s = session(pipelined=True)
        s.row_price = price
        s.start(time.time())
        sent = drain(s)
        assert any(o.prepared_for is not None for o in sent) is prepared


def test_a_node_price_is_taken_by_every_session():
    """The target's node price reaches every tree's session (CaPE's too: a continuation taken up
    past a sibling keeps the places that pay) and an async chain's (its blocks drafted past a stop
    pay for their nodes); no word leaves the last price standing."""
    from draft_worker.service import _price

    s = session(pipelined=True)
    _price(s, 0.5)
    assert s.session.node_price == 0.5
    s.session.tree = "cape"
    _price(s, 0.25)
    _price(s, None)
    assert s.session.node_price == 0.25
