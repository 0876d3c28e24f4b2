"""Prepared continuations: drafted while a block is verified, for a rejection the draft thinks
likely, and verified only when the target's correction is the token they assumed.

Target side: the session host dials a scripted draft that sends a block the target rejects at
its first token, plus prepared continuations for that rejection, one for the target's correction
and one for another token; only the first is verified, with no round trip. Draft side: a real
draft session prepares continuations between messages; a feedback that names one it sent uses
it, one it kept (sampled, or late) is sent again, and any other correction is drafted afresh."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from coordinator.session.host import SessionHost
from draft_worker.drafter import Drafter
from draft_worker.pipelined import PipelinedDraft
from draft_worker.stepping import work
from svip_common.contracts import NO_TOKEN, Block, Limits, PolicyConfig, SamplingParams
from svip_common.pair_config import PairConfig
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from svip_runtime.grpc_server import start_server
from svip_runtime.wire_batch import unpack
from target_worker.verifier import Verifier
from tests.verdicts import apply_verdict

# crafted blocks reach the verifier as sent: no load-aware pause (test_load_aware.py), no tokens of the
# target's own settled while it waits for them (test_idle_prefill.py)
OFF = PairConfig("target", "draft", load_aware="off", idle_prefill="off")

PROMPT = (5, 6, 7)


class ScriptedDraft(pb_grpc.DraftWorkerServicer):
    """A draft worker of the real interface: on a start it sends the scripted blocks; on a
    feedback that needs a new block it sends an empty one (the target settles the next place)."""

    def __init__(self):
        self.script: dict[str, list[pb.Block]] = {}
        self.feedback: dict[str, list[pb.Feedback]] = {}

    async def Session(self, request_iterator, context):
        async for message in request_iterator:
            for request, _ in unpack(message, pb.DraftRequest):  # a step's requests may come as one message
                for event in self._answer(request):
                    yield event

    def _answer(self, request: pb.DraftRequest) -> list[pb.DraftEvent]:
        kind = request.WhichOneof("kind")
        if kind == "start":
            return [pb.DraftEvent(block=block) for block in self.script[request.start.session_id]]
        if kind != "feedback":
            return []
        fb = request.feedback
        while True:
            self.feedback.setdefault(fb.session_id, []).append(fb)
            if not fb.HasField("then"):
                break
            fb = fb.then
        if fb.prepared_used or fb.token == NO_TOKEN:
            return []
        return [pb.DraftEvent(block=pb.Block(session_id=fb.session_id, epoch=fb.epoch, base=fb.base + fb.accepted + 1))]


@pytest.fixture(scope="module")
def host(models, loop):
    limits = Limits(tokens=models["target"].token_limit, positions=512)
    draft = ScriptedDraft()
    server, port = loop.run_until_complete(
        start_server(lambda s: pb_grpc.add_DraftWorkerServicer_to_server(draft, s), "d")
    )
    # the scripted blocks must reach the verifier as sent: no load-aware pause (test_load_aware.py), and
    # no tokens of the target's own settled while it waits for them (test_idle_prefill.py)
    target = SessionHost(Verifier(models["target"], limits.tokens), limits, OFF, f"127.0.0.1:{port}")
    loop.run_until_complete(target.start())
    yield target, draft
    loop.run_until_complete(target.close())
    loop.run_until_complete(server.stop(None))


def greedy_next(model, ids) -> int:
    with torch.inference_mode():
        return int(model(torch.tensor([list(ids)])).logits[0, -1].argmax())


def run_session(target: SessionHost, session_id: str, max_new: int, loop) -> tuple[list[int], pb.Finished]:
    """Start a greedy session on the host in-process (its Generate stream) and collect it."""

    async def go():
        requests: asyncio.Queue = asyncio.Queue()

        async def gen():
            while (r := await requests.get()) is not None:
                yield r

        start = pb.StartSession(
            session_id=session_id,
            prompt_ids=list(PROMPT),
            max_new_tokens=max_new,
            sampling=pb.SamplingParams(top_p=1.0),
            pipeline=pb.PIPELINE_ASYNC,
            policy=pb.PolicyConfig(
                name="constant", draft_length=1, max_draft_length=8, entropy_scale=0.15, threshold=0.3, confidence=0.4
            ),
        )
        requests.put_nowait(pb.GenerateRequest(start=start))
        tokens, events = [], target.Generate(gen(), None)
        async for event in events:
            kind = event.WhichOneof("kind")
            assert kind != "error", event.error.message
            if kind == "settled":
                tokens += event.settled.tokens
            elif kind == "finished":
                requests.put_nowait(None)
                await events.aclose()
                return tokens, event.finished

    return loop.run_until_complete(asyncio.wait_for(go(), 30))


@pytest.mark.parametrize("offered", ["match", "other", "both"])
def test_a_prepared_continuation_is_verified_only_when_the_correction_matches(host, models, loop, offered):
    target, draft = host
    model = models["target"].model
    x = greedy_next(model, PROMPT)  # the target's correction at the first place
    wrong = (x + 1) % 300  # a drafted token the target rejects there
    y = (x + 2) % 300  # another correction a prepared continuation may assume
    c_x = greedy_next(model, (*PROMPT, x))  # what follows x: the prepared block's token, accepted
    session_id = f"prep-{offered}"
    prepared = {"match": [(x, c_x)], "other": [(y, c_x)], "both": [(y, c_x), (x, c_x)]}[offered]
    # the prepared blocks are sent first, so they are at the target before the verdict (a real
    # draft sends them while the block is verified; one that arrives late is discarded there)
    blocks = [
        pb.Block(
            session_id=session_id,
            base=len(PROMPT) + 1,
            tokens=[follow],
            prepared_for=pb.PreparedFor(base=len(PROMPT), accepted=0, token=token),
        )
        for token, follow in prepared
    ]
    draft.script[session_id] = blocks + [pb.Block(session_id=session_id, base=len(PROMPT), tokens=[wrong])]
    before = target.verifier.tokens_verified
    tokens, finished = run_session(target, session_id, max_new=4, loop=loop)
    reference = list(PROMPT)
    for _ in range(4):
        reference.append(greedy_next(model, reference))
    assert tokens == reference[len(PROMPT) :]  # exact, whatever was prepared
    first = draft.feedback[session_id][0]
    assert (first.accepted, first.token) == (0, x)
    rounds = finished.stats.rounds
    used = offered != "other"
    assert first.prepared_used == used
    assert [r.source for r in rounds][:2] == ["first", "prepared" if used else "drafted"]
    assert finished.stats.prepared_used == int(used)
    # tokens verified: the rejected block, then the prepared one if it was used, then empty blocks;
    # a prepared block for another correction is never verified
    assert target.verifier.tokens_verified - before == 1 + int(used)
    assert finished.stats.discarded_tokens == len(prepared) - int(used)


def test_a_stale_or_parentless_prepared_block_is_never_verified(host, models, loop):
    """Prepared for a block whose verdict is already out: discarded, counted, never verified."""
    target, draft = host
    model = models["target"].model
    x = greedy_next(model, PROMPT)
    session_id = "prep-late"
    draft.script[session_id] = [
        pb.Block(session_id=session_id, base=len(PROMPT), tokens=[(x + 1) % 300]),
        pb.Block(
            session_id=session_id,
            base=len(PROMPT) - 2,
            tokens=[x],  # its parent is long decided
            prepared_for=pb.PreparedFor(base=len(PROMPT) - 3, accepted=0, token=x),
        ),
    ]
    before = target.verifier.tokens_verified
    tokens, finished = run_session(target, session_id, max_new=3, loop=loop)
    assert target.verifier.tokens_verified - before == 1
    assert finished.stats.prepared_used == 0 and finished.stats.discarded_tokens == 1


def _pipelined(models, parallel: int, tree: str = "off") -> PipelinedDraft:
    drafter = Drafter(models["close_draft"], models["target"].vocab_size)
    policy = PolicyConfig(name="svip", threshold=0.6, tree=tree)
    session = drafter.open(SamplingParams(), policy, ())
    return PipelinedDraft(
        session=session,
        prompt=list(PROMPT),
        max_new_tokens=200,  # room past a block of the cap (40): speculation drafts on past its stops
        stop_token_ids=frozenset(),
        pipelined=True,
        prepare=2,
        parallel=parallel,
        send_prepared=True,
    )


@pytest.fixture(params=[1, 3], ids=["one at a time", "side by side"])
def draft_session(models, request):
    return _pipelined(models, request.param)


def _prepare_everything(draft: PipelinedDraft) -> list:
    sent = []
    while (ready := work(draft, time.time())) is not None:
        sent += ready
    return sent


def _first_block(draft: PipelinedDraft):
    """Start the session and draft its first block (the critical job) a forward at a time."""
    sent = draft.start(0.0)
    while not sent:
        sent = work(draft, time.time())
    return sent[0]


def test_the_draft_prepares_continuations_for_its_likely_corrections(draft_session):
    first = _first_block(draft_session)
    sent = _prepare_everything(draft_session)
    followups = [o for o in sent if o.prepared_for is None]
    prepared = [o for o in sent if o.prepared_for is not None]
    assert len(followups) == 1 and followups[0].block.base == first.block.base + len(first.block)
    assert prepared and all(o.block.base == o.prepared_for[0] + o.prepared_for[1] + 1 for o in prepared)
    for o in prepared:  # each assumes a token the draft ranked below its own choice at that place
        base, j, token = o.prepared_for
        parent = first if base == first.block.base else followups[0]
        assert token != parent.block.tokens[j] and token in [t for t, _ in parent.alternatives[j]]


def test_a_step_names_each_token_drafted_for_a_prepared_continuation_and_no_other(draft_session):
    """PipelinedDraft.preparing, which DraftService counts a token by (WorkerStats.prepared_tokens):
    the tokens it names are the prepared continuations' own, sent or still in the making; never
    the follow-up's or the critical block's."""
    _first_block(draft_session)
    named, sent = 0, []
    while drafts := draft_session.next_drafts(time.time()):
        named += sum(map(draft_session.preparing, drafts))
        followups = [job.draft for job in draft_session.jobs if job.followup]
        assert not any(map(draft_session.preparing, followups))
        draft_session.session._drafter.step(drafts)
        sent += draft_session.after_step(time.time(), 0.0)
    prepared = [o for o in sent if o.prepared_for is not None]
    unsent = [job.draft for job in draft_session.jobs if not job.followup]
    assert prepared and named == sum(len(o.block.tokens) for o in prepared) + sum(len(d.block.tokens) for d in unsent)


def test_feedback_naming_a_prepared_continuation_uses_it_and_any_other_correction_is_drafted(draft_session, models):
    first = _first_block(draft_session)
    prepared = [o for o in _prepare_everything(draft_session) if o.prepared_for is not None]
    base, j, token = prepared[0].prepared_for
    assert base == first.block.base
    # the target used it: nothing new to send, the prepared block is now the one under verification
    assert apply_verdict(draft_session, time.time(), 1, base, len(first.block), j, token, None, True, 0.0) == []
    assert draft_session.outstanding[0] is prepared[0] and prepared[0].block.epoch == 1


def test_a_prepared_continuation_the_target_did_not_use_is_sent_again(draft_session):
    first = _first_block(draft_session)
    prepared = [o for o in _prepare_everything(draft_session) if o.prepared_for is not None]
    base, j, token = prepared[0].prepared_for
    (again,) = apply_verdict(draft_session, time.time(), 1, base, len(first.block), j, token, None, False, 0.0)
    assert again is prepared[0] and again.reused and again.prepared_for is None and again.block.epoch == 1


def test_a_correction_nothing_was_prepared_for_is_drafted_from(draft_session):
    first = _first_block(draft_session)
    prepared = [o for o in _prepare_everything(draft_session) if o.prepared_for is not None]
    assumed = {(b, j, t) for b, j, t in (o.prepared_for for o in prepared)}
    token = next(t for t in range(300) if (first.block.base, 0, t) not in assumed and t != first.block.tokens[0])
    now = time.time()
    assert apply_verdict(draft_session, now, 1, first.block.base, len(first.block), 0, token, None, False, 0.0) == []
    (fresh,) = work(draft_session, time.time())  # the critical job: drafted from the correction
    assert fresh not in prepared and not fresh.reused and fresh.block.base == first.block.base + 1
    assert draft_session.known[-1] == token


def test_a_rejection_whose_continuation_is_half_drafted_takes_it_up_as_the_next_block(draft_session):
    """Issue 60: the verdict rejects where a prepared continuation is still being drafted: that job
    goes on as the block the target waits for (its fork the session's cache, its forwards kept), and
    sends what a block drafted afresh from the correction would hold (up to SVIP's stop; all it
    holds if it passed one already)."""
    first = _first_block(draft_session)
    job = None
    while job is None:
        assert work(draft_session, time.time()) is not None, "no continuation was ever half drafted"
        job = next((j for j in draft_session.jobs if j.prepared_for and j.draft.block.tokens), None)
    base, j, token = job.prepared_for
    fork, held = job.draft.cache, job.draft.block
    sent = apply_verdict(draft_session, time.time(), 1, base, len(first.block), j, token, None, False, 0.0)
    while not sent:
        assert draft_session.critical is job  # not begun again
        sent = work(draft_session, time.time())
    (block,) = sent
    assert block.block is held and block.prepared_for is None and block.block.epoch == 1 and block.reused
    known = draft_session.known
    assert known == list(PROMPT) + first.block.tokens[:j] + [token] and held.base == len(known)
    if fork is not None:
        assert draft_session.session._seq is fork
    policy = PolicyConfig(name="svip", threshold=0.6)
    fresh = draft_session.session._drafter.open(SamplingParams(), policy, ())
    afresh = fresh.propose(known, 200 - len(known) + len(PROMPT) - 1).tokens
    assert held.tokens[: len(afresh)] == afresh and (job.draft.extended or held.tokens == afresh)
    fresh.close()
    pool = draft_session.session._drafter.pool
    draft_session.close()
    assert pool.used_pages == 0


def test_a_branch_whose_continuation_is_half_drafted_takes_it_up_past_the_token_settled_after_it(models):
    """Issue 60: a tree's verdict takes a sibling and the target settles the place after it (the
    continuation prepared after that sibling was not in time), while that continuation is still
    being drafted and drafted that very token: the job goes on past it as the block the target
    waits for (its fork the session's cache, nothing drafted again), and sends the tree a block
    begun there holds."""
    draft = _pipelined(models, 3, tree="cape")
    first = _first_block(draft)
    job = None
    while job is None:
        assert work(draft, time.time()) is not None, "no continuation after a sibling was ever half drafted"
        job = next((j for j in draft.jobs if j.prepared_for and j.prepared_for[0] == first.block.base
                    and j.prepared_for[2] in first.block.siblings[j.prepared_for[1]]
                    and len(j.draft.block.tokens) >= 2), None)
    base, j, sibling = job.prepared_for
    held, own_stops = list(job.draft.block.tokens), [at - 1 for at in job.draft.stops_passed if at > 1]
    fork, forwards = job.draft.cache, draft.session.forwards
    sent = apply_verdict(draft, time.time(), 1, base, len(first.block), j, held[0], None, False, 0.0,
                         branch=(sibling,))
    while not sent:
        assert draft.critical is job  # not begun again
        sent = work(draft, time.time())
    (block,) = sent
    known = draft.known
    assert known == list(PROMPT) + first.block.tokens[:j] + [sibling, held[0]]
    assert block.block.base == len(known) and block.reused and block.prepared_for is None and block.block.epoch == 1
    assert len(block.block.siblings) == len(block.tokens)
    assert block.tokens[: len(held) - 1] == held[1:]  # the node price is 0 here: every place it held pays
    assert draft.session.forwards - forwards == max(0, len(block.tokens) - (len(held) - 1))  # only what it added
    if fork is not None:
        assert draft.session._seq is fork
    fresh = draft.session._drafter.open(SamplingParams(), PolicyConfig(name="svip", threshold=0.6, tree="cape"), ())
    afresh = fresh.propose(known, 200 - len(known) + len(PROMPT) - 1).tokens
    assert block.tokens[: len(afresh)] == afresh and (job.draft.extended or block.tokens == afresh)
    assert not own_stops or block.tokens == held[1:]  # past its own stop: it leaves at once
    fresh.close()
    pool = draft.session._drafter.pool
    draft.close()
    assert pool.used_pages == 0


@pytest.mark.parametrize("tree", ["off", "cape"])
@pytest.mark.parametrize("price", [0.0, 1e9])
def test_a_block_taken_up_past_settled_tokens_keeps_the_places_past_its_stop_that_pay(models, tree, price):
    """BlockDraft.go_on_past (a continuation after a sibling, taken up past the tokens its verdict
    settled): the policy's stops it drafted on past before the cut are no longer its own; past one
    after it, it keeps the places that pay for their nodes at the target's node price (all when
    nodes are free; at a price none pays, it ends at that stop), with their siblings and runners-up,
    nothing drafted again; holding nothing past the cut, it drafts on to a stop of its own."""
    drafter = Drafter(models["close_draft"], models["target"].vocab_size)
    policy = PolicyConfig(name="svip", threshold=0.01, tree=tree)  # SVIP this low stops at every token
    session = drafter.open(SamplingParams(), policy, ())
    session.node_price = price
    draft = session.begin(list(PROMPT), 40, alternatives=True)
    draft.extends = lambda: True  # off the critical path: it drafts on past each stop
    for _ in range(4):
        assert not draft.step()
    assert draft.stops_passed == [1, 2, 3, 4] and draft.extended == 4
    tokens, siblings, forwards = list(draft.block.tokens), draft.block.siblings, session.forwards
    kept = 4 if price == 0.0 else 3
    assert draft.go_on_past(2)
    assert draft.block.base == len(PROMPT) + 2 and draft.block.tokens == tokens[2:kept]
    assert len(draft.alternatives) == kept - 2 and session.forwards == forwards
    assert draft.block.siblings == (None if siblings is None else siblings[2:kept])
    session.close()
    session = drafter.open(SamplingParams(), policy, ())
    draft = session.begin(list(PROMPT), 40, alternatives=True)
    draft.extends = lambda: True
    draft.step(), draft.step()
    assert not draft.go_on_past(2) and draft.block.tokens == [] and draft.extended == 0
    draft.extends = None  # the block the target waits for: no clock of its own
    assert draft.step() and len(draft.block.tokens) == 1  # its own first stop
    session.close()


@pytest.mark.parametrize("tree", ["off", "cape"])
def test_a_block_in_the_making_takes_a_cap_it_can_keep(models, tree):
    """What a half-drafted continuation must allow to be taken up (BlockDraft.cap): a chain takes
    any cap above what it holds; a tree keeps the node budget its spine's cap set, so it takes one
    only as high as that."""
    drafter = Drafter(models["close_draft"], models["target"].vocab_size)
    session = drafter.open(SamplingParams(), PolicyConfig(name="constant", draft_length=8, tree=tree), ())
    draft = session.begin(list(PROMPT), 40, alternatives=True)
    draft.step()
    assert not draft.cap(1)  # it holds that many already
    assert draft.cap(8)  # its own cap: nothing changes
    assert draft.cap(3) is (tree == "off")  # lower: a chain stops there, a tree cannot
    while not draft.step():
        pass
    assert len(draft.block) == (3 if tree == "off" else 8)
    session.close()


@pytest.mark.parametrize("tree", ["off", "cape"])
def test_a_block_past_its_stop_ends_where_it_stands_once_its_clock_says_no_more(models, tree):
    """BlockDraft.end_extension, for a forward the block sits out (PipelinedDraft.sat_out): past
    its policy's stop and drafted on by its clock, it ends where it stands once the clock says no
    more forward fits, a tree's last siblings with it; before its first stop, or while the clock
    allows, it goes on."""
    drafter = Drafter(models["close_draft"], models["target"].vocab_size)
    # SVIP this low stops at every token: past its first stop at once
    session = drafter.open(SamplingParams(), PolicyConfig(name="svip", threshold=0.01, tree=tree), ())
    draft = session.begin(list(PROMPT), 40, alternatives=True)
    room = [True]
    draft.extends = lambda: room[0]
    room[0] = False
    assert not draft.end_extension()  # nothing drafted, no stop passed: not its clock's to end
    room[0] = True
    assert not draft.step() and draft.extended == 1
    assert not draft.end_extension()  # its clock allows more
    assert not draft.step() and draft.extended == 2
    drafted = len(draft.block)
    room[0] = False
    assert draft.end_extension() and len(draft.block) == drafted
    if tree == "cape":
        assert len(draft.block.siblings) == drafted
    session.close()



def test_a_block_split_after_its_cut_drafts_on_as_one_begun_there(models):
    """BlockDraft.split_off, for a follow-up the target cut before all it holds (growth.py): the
    tokens past the cut, with their q, entropies and runners-up, become the block, which drafts on
    from where it stands; every token is the one a block begun at the cut drafts, with nothing
    drafted again. A split that keeps nothing before the cut, or more than the block holds, is
    refused; one that keeps nothing past it, only while the block drafts on."""
    drafter = Drafter(models["close_draft"], models["target"].vocab_size)
    session = drafter.open(SamplingParams(), PolicyConfig(name="constant", draft_length=6), ())
    draft = session.begin(list(PROMPT), 40, alternatives=True)
    for _ in range(4):
        draft.step()
    drafted, forwards = list(draft.block.tokens), session.forwards
    for keep in (0, 5):
        with pytest.raises(ValueError, match="keeping some past the cut"):
            draft.split_off(keep)
    draft.split_off(3)
    assert draft.block.base == len(PROMPT) + 3 and draft.block.tokens == drafted[3:]
    while not draft.step():
        pass
    assert session.forwards == forwards + 2  # the 4th token was not drafted again
    fresh_session = drafter.open(SamplingParams(), PolicyConfig(name="constant", draft_length=3), ())
    fresh = fresh_session.begin(list(PROMPT) + drafted[:3], 40, alternatives=True)
    while not fresh.step():
        pass
    assert draft.block.tokens == fresh.block.tokens and len(draft.block.tokens) == 3
    for ours, theirs in zip(draft.alternatives, fresh.alternatives, strict=True):  # (a prefill's rounding apart)
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert [q for _, q in ours] == pytest.approx([q for _, q in theirs], rel=1e-4)
    assert draft.block.probs == pytest.approx(fresh.block.probs, rel=1e-4)
    assert draft.block.entropies == pytest.approx(fresh.block.entropies, rel=1e-4)
    while not draft.step():  # done: a split must keep some past the cut now
        pass
    with pytest.raises(ValueError, match="keeping some past the cut"):
        draft.split_off(len(draft.block.tokens))
    for s in (session, fresh_session):
        s.close()


def test_a_flat_tree_split_after_its_cut_keeps_its_siblings_and_drafts_on_as_one_begun_there(models):
    """BlockDraft.split_off of a CaPE tree (a continuation prepared after a sibling, past the token
    the verdict settled after it: pipelined.py): its places past the cut keep their siblings, and
    it drafts on to the tree a block begun at the cut drafts under the same cap. A deep tree's
    (nodes grow below its siblings, hanging from places cut off) is refused, and so is a cut of a
    block with grown nodes (Block.after)."""
    drafter = Drafter(models["close_draft"], models["target"].vocab_size)
    policy = PolicyConfig(name="constant", draft_length=6, tree="cape")
    tree = drafter.open(SamplingParams(), policy, ())
    branching = tree.begin(list(PROMPT), 40, alternatives=True)
    branching.step(), branching.step()
    spine, siblings, forwards = list(branching.block.tokens), list(branching.block.siblings), tree.forwards
    branching.split_off(1)
    assert branching.block.base == len(PROMPT) + 1 and branching.block.tokens == spine[1:]
    assert branching.block.siblings == siblings[1:]
    while not branching.step():
        pass
    assert tree.forwards == forwards + 4 and len(branching.block.tokens) == 5  # six in all, one cut off
    fresh_session = drafter.open(SamplingParams(), PolicyConfig(name="constant", draft_length=5, tree="cape"), ())
    fresh = fresh_session.begin(list(PROMPT) + spine[:1], 40, alternatives=True)
    while not fresh.step():
        pass
    assert branching.block.tokens == fresh.block.tokens and branching.block.siblings == fresh.block.siblings
    deep_session = drafter.open(SamplingParams(), PolicyConfig(name="constant", draft_length=6, tree="deep"), ())
    deep = deep_session.begin(list(PROMPT), 40, alternatives=True)
    deep.step(), deep.step()
    with pytest.raises(ValueError, match="flat tree"):
        deep.split_off(1)
    grown = Block(base=3, tokens=[5, 6], probs=[0.9, 0.9], entropies=[0.1, 0.1], siblings=[[7], []], grown=[(2, 8)])
    with pytest.raises(ValueError, match="grown below its siblings"):
        grown.after(1)
    for s in (tree, fresh_session, deep_session):
        s.close()

def test_continuations_drafted_side_by_side_on_forks_are_the_ones_drafted_one_at_a_time(models):
    made = {}
    for parallel in (1, 3):
        draft = _pipelined(models, parallel)
        _first_block(draft)
        made[parallel] = {o.prepared_for: o.block.tokens for o in _prepare_everything(draft)}
        pool = draft.session._drafter.pool
        draft.close()
        assert pool.used_pages == 0  # forks and all
    both = made[1].keys() & made[3].keys()  # which ones depends on when the plan is redone
    # one at a time a continuation ends at its stop, its place wanted by the next (stepping.py _extends);
    # side by side it may draft on past it: the same greedy chain, one a prefix of the other
    assert len(both) >= 3
    for key in both:
        n = min(len(made[1][key]), len(made[3][key]))
        assert n >= 1 and made[3][key][:n] == made[1][key][:n]


def test_the_fork_the_verdict_calls_for_becomes_the_sessions_cache(models):
    draft = _pipelined(models, 3)
    first = _first_block(draft)
    prepared = [o for o in _prepare_everything(draft) if o.prepared_for is not None]
    assert set(draft.prepared.forks) == {o.prepared_for for o in prepared}  # each on its own fork
    base, j, token = prepared[0].prepared_for
    late = time.time() + 3600.0  # a slow verdict: the next one leaves time to draft ahead
    assert apply_verdict(draft, time.time(), 1, base, len(first.block), j, token, None, True, late) == []
    cached, expected = draft.session._seq.tokens, draft.known + prepared[0].block.tokens
    assert len(cached) == len(expected) - 1 and cached == expected[:-1]  # its last token goes in next
    pool = draft.session._drafter.pool
    assert draft.prepared.forks == {} and pool.used_pages == len(draft.session._seq.pages)  # the rest went back
    followup = next(o for o in _prepare_everything(draft) if o.prepared_for is None)  # from the adopted cache
    assert followup.block.base == len(expected)
    # (a follow-up drafts past its policy's stops while its verdict is not due: a constant length here)
    fresh = draft.session._drafter.open(SamplingParams(), PolicyConfig(name="constant",
                                                                       draft_length=len(followup.block)), ())
    assert fresh.propose(expected, len(followup.block)).tokens[: len(followup.block)] == followup.block.tokens
    fresh.close()
    draft.close()
    assert pool.used_pages == 0


def test_a_short_pool_takes_the_forks_back_and_their_blocks_still_serve(models):
    draft = _pipelined(models, 3)
    first = _first_block(draft)
    prepared = [o for o in _prepare_everything(draft) if o.prepared_for is not None]
    pool = draft.session._drafter.pool
    assert draft.release_forks() and pool.used_pages == len(draft.session._seq.pages)
    assert not draft.release_forks()  # nothing left to give
    base, j, token = prepared[0].prepared_for
    late = time.time() + 3600.0
    assert apply_verdict(draft, time.time(), 1, base, len(first.block), j, token, None, True, late) == []
    assert draft.outstanding == [prepared[0]]  # its tokens were sent: the target verifies them
    followup = next(o for o in _prepare_everything(draft) if o.prepared_for is None)  # as without forks
    assert followup.block.base == prepared[0].block.base + len(prepared[0].block)


def test_a_followup_drafts_past_its_policys_stop_until_its_verdict_is_due(models):
    """Issue 60: a block the target is not waiting for is off the critical path: the follow-up drafts
    on past SVIP's stops (counted: where the draft expects a rejection) while its verdict is not due,
    the same tokens a block of that length would hold; the critical block still stops at SVIP's."""
    draft = _pipelined(models, 1)
    first = _first_block(draft)
    policy = PolicyConfig(name="svip", threshold=0.6)
    fresh = draft.session._drafter.open(SamplingParams(), policy, ())
    assert len(first.block) == len(fresh.propose(list(PROMPT), 40).tokens)  # critical: SVIP's own stop
    (followup,) = [o for o in _prepare_everything(draft) if o.prepared_for is None]
    shortest = fresh.propose(list(PROMPT) + first.block.tokens, 40)
    assert len(followup.block) > len(shortest.tokens) and followup.block.tokens[: len(shortest)] == shortest.tokens
    fresh.close()
    draft.close()


def test_a_followup_that_turns_critical_past_its_stop_leaves_at_once(models):
    """The whole block accepted while its follow-up drafts past a stop: the target now waits for the
    follow-up, which is sent with what it holds (not drafted on to its next stop)."""
    draft = _pipelined(models, 3)
    first = _first_block(draft)
    job = None
    while job is None or not job.draft.extended:
        sent = work(draft, time.time())
        assert sent is not None and all(o.prepared_for is not None for o in sent)  # the follow-up drafts on
        job = next((j for j in draft.jobs if j.followup), None)
    held = list(job.draft.block.tokens)
    (sent,) = apply_verdict(draft, time.time(), first.block.epoch, first.block.base, len(first.block),
                                len(first.block), NO_TOKEN, None, False, time.time())
    assert sent.block.tokens == held and draft.critical is None and draft.outstanding == [sent]
    draft.close()


def test_a_token_drafted_past_a_stop_rides_a_step_with_a_critical_block_only_where_its_chance_pays(
        models, monkeypatch):
    """At several sessions the draft's batched step is shared: a block some target waits for is in
    it, and a row drafted past its stop delays that block by what a row adds to the step. It rides
    only if the draft gives its block more chance of being accepted so far than that price (the
    floor under what is prepared: row_share times the critical blocks riding); the rest wait for
    a step without one, and the session is told what sat out (PipelinedDraft.sat_out: one that
    cannot grow in time leaves)."""
    from types import SimpleNamespace

    import draft_worker.service as service_module
    from draft_worker.service import DraftService
    from svip_runtime.compute_loop import ManualLoop

    service = DraftService(Drafter(models["close_draft"], models["target"].vocab_size), Limits(tokens=320,
                                                                                                positions=512),
                           compute=ManualLoop)
    stepped = []
    monkeypatch.setattr(service, "_step_within_pool", lambda batch: stepped.append([d.name for *_, d in batch]) or [])
    monkeypatch.setattr(service_module, "row_share", lambda cost: 0.1)  # a row: a tenth of a step of one
    service.riding = SimpleNamespace(value=2.0, update=lambda value: None)  # two critical blocks ride: price 0.2

    sat = []

    def session(critical: bool, *drafts):
        return SimpleNamespace(critical=object() if critical else None, next_drafts=lambda now: list(drafts),
                               after_step=lambda now, s: [],
                               sat_out=lambda now, out: sat.append([d.name for d in out]) or [])

    def draft(name: str, extended: int = 0, reach: float = 1.0):
        return SimpleNamespace(name=name, extended=extended, reach=reach, error=None, pending_tokens=1)

    speculation = (draft("b-past-stop-likely", 2, 0.5), draft("b-past-stop-doubtful", 1, 0.15), draft("b-prepared"))
    service.sessions = {"a": session(True, draft("a-critical")), "b": session(False, *speculation)}
    service.idle()
    service.sessions = {"b": session(False, *speculation)}
    service.idle()
    assert stepped == [["a-critical", "b-past-stop-likely", "b-prepared"],
                       ["b-past-stop-likely", "b-past-stop-doubtful", "b-prepared"]]
    assert sat == [["b-past-stop-doubtful"]]


def test_the_draft_worker_prices_a_speculative_row_by_what_it_adds_to_a_step_with_a_critical_block(models,
                                                                                                   monkeypatch):
    """Each batched step (prompts aside) is timed by the tokens it takes in. A speculative row
    delays each block some target waits for in the same step: alone (one session: a critical
    block steps alone) it is free; beside other sessions' critical blocks it costs the share one
    more row adds to a step of one, once for each. That price (row_price) is the floor under what
    is prepared."""
    from types import SimpleNamespace

    from draft_worker.service import DraftService
    from svip_common.step_cost import row_share
    from svip_runtime.compute_loop import ManualLoop

    clock = SimpleNamespace(now=0.0)
    service = DraftService(Drafter(models["close_draft"], models["target"].vocab_size),
                           Limits(tokens=320, positions=512), compute=ManualLoop, timer=lambda: clock.now)

    def step(batch):  # 2 ms and 0.5 ms a token taken in
        clock.now += 0.002 + 0.0005 * sum(d.pending_tokens for *_, d in batch)
        return batch

    monkeypatch.setattr(service, "_step_within_pool", step)
    monkeypatch.setattr(service, "_send", lambda session_id, session, blocks: None)

    def session(critical: bool, width: int, pending: int = 1):
        drafts = [SimpleNamespace(extended=0, error=None, pending_tokens=pending) for _ in range(width)]
        return SimpleNamespace(critical=object() if critical else None, row_price=None, next_drafts=lambda now: drafts,
                               after_step=lambda now, s: [], preparing=lambda draft: False)

    speculating = session(False, 1)
    for width in [1, 6] * 10:  # one session: speculation never rides with a critical block
        service.sessions = {"b": session(False, width)}
        service.idle()
    service.sessions = {"b": speculating, "prompt": session(False, 1, pending=300)}  # a prompt prices no row
    service.idle()
    assert row_share(service.step_cost) == pytest.approx(0.0005 / 0.0025)
    service.idle()
    assert speculating.row_price == 0.0
    for _ in range(200):  # beside two other sessions' critical blocks in every step: it delays both
        service.sessions = {"a": session(True, 1), "c": session(True, 1), "b": speculating}
        service.idle()
    assert speculating.row_price == pytest.approx(2 * row_share(service.step_cost), rel=0.01)
