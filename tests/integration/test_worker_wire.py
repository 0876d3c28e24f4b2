"""The workers do not trust the wire: real gRPC on loopback against the draft worker's service and
the target worker's session host (hosted here, without Ray; the host dials a scripted draft). A
session belongs to the stream that opened it, a duplicate start leaves the original alone, an
empty message is INVALID_ARGUMENT, blocks past the context or the session's budget or the cap
are refused, ids past the draft's embedding never reach it, and a stream's sessions are freed
when it goes away."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import torch

from draft_worker.drafter import Drafter
from draft_worker.service import DraftService
from svip_common.contracts import Limits
from svip_common.pair_config import PairConfig
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from svip_runtime.compute_loop import ComputeLoop, ManualLoop
from svip_runtime.grpc_server import MAX_QUEUED_EVENTS, SessionService, start_server
from target_worker.verifier import Verifier

# crafted blocks reach the verifier as sent: no load-aware pause (test_load_aware.py), no tokens of the
# target's own settled while it waits for them (test_idle_prefill.py)
OFF = PairConfig("target", "draft", load_aware="off", idle_prefill="off")

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.fixture(scope="module")
def limits(models):
    # the tiny target has 512 positions; this deployment serves 64, and blocks of at most 8
    return Limits(tokens=models["target"].token_limit, positions=64, max_draft_length=8)


class FakeDraft(pb_grpc.DraftWorkerServicer):
    """A draft worker of the real interface that sends what a test scripts: nothing (a session that
    stays open), crafted blocks a real draft never would, or crafted messages as they are."""

    def __init__(self):
        self.script: dict[str, list[pb.Block]] = {}
        self.raw: dict[str, list[pb.DraftEvent]] = {}

    async def Session(self, request_iterator, context):
        from svip_runtime.wire_batch import unpack

        async for message in request_iterator:
            for request, _ in unpack(message, pb.DraftRequest):  # a step's requests may come as one message
                if request.WhichOneof("kind") == "start":
                    for block in self.script.get(request.start.session_id, []):
                        yield pb.DraftEvent(block=block)
                    for event in self.raw.get(request.start.session_id, []):
                        yield event


@pytest.fixture(scope="module")
def services(models, limits, loop):
    from coordinator.session.host import SessionHost

    draft = DraftService(Drafter(models["close_draft"], models["target"].vocab_size, limits.tokens), limits)
    fake = FakeDraft()
    servers = []

    def serve(servicer, add):
        server, port = loop.run_until_complete(start_server(lambda s: add(servicer, s), "svip.v1.Test"))
        servers.append(server)
        return f"127.0.0.1:{port}"

    draft.address = serve(draft, pb_grpc.add_DraftWorkerServicer_to_server)
    fake_address = serve(fake, pb_grpc.add_DraftWorkerServicer_to_server)
    # crafted blocks must meet the checks they target, not a load-aware pause (test_load_aware.py) nor
    # tokens the target settled alone while it waited for them; a session the fake draft leaves
    # waiting stays open (test_idle_prefill.py)
    target = SessionHost(Verifier(models["target"], limits.tokens), limits, OFF, fake_address)
    loop.run_until_complete(target.start())
    target.address = serve(target, pb_grpc.add_TargetWorkerServicer_to_server)
    yield {"target": target, "draft": draft, "fake": fake}
    for server in servers:
        loop.run_until_complete(server.stop(None))
    loop.run_until_complete(target.close())


class Stream:
    """One raw bidirectional stream to a worker, driven by hand."""

    def __init__(self, address: str, role: str):
        self.channel = grpc.aio.insecure_channel(address)
        if role == "target":
            self.call = pb_grpc.TargetWorkerStub(self.channel).Generate(self._gen())
        else:
            self.call = pb_grpc.DraftWorkerStub(self.channel).Session(self._gen())
        self.requests: asyncio.Queue = asyncio.Queue()

    async def _gen(self):
        while (r := await self.requests.get()) is not None:
            yield r

    def send(self, request) -> None:
        self.requests.put_nowait(request)

    async def read(self, timeout: float = 10.0):
        return await asyncio.wait_for(self.call.read(), timeout)

    async def close(self) -> None:
        self.requests.put_nowait(None)
        self.call.cancel()
        await self.channel.close()


def start(session_id: str, prompt=(5, 6, 7), max_new_tokens: int = 20, policy: str = "constant",
          max_draft_length: int = 8) -> pb.StartSession:
    msg = pb.StartSession(session_id=session_id, prompt_ids=list(prompt), max_new_tokens=max_new_tokens,
                          sampling=pb.SamplingParams(top_p=1.0), pipeline=pb.PIPELINE_SYNC)
    msg.policy.CopyFrom(pb.PolicyConfig(name=policy, threshold=0.3, entropy_scale=0.15, draft_length=3,
                                        max_draft_length=max_draft_length, confidence=0.4))
    return msg


def request(role: str, **kind):
    return pb.GenerateRequest(**kind) if role == "target" else pb.DraftRequest(**kind)


async def wait_for(predicate, timeout: float = 60.0) -> None:
    """Until predicate() holds; the timeout only bounds a failure."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)


def test_a_session_belongs_to_the_stream_that_opened_it(services, loop):
    target = services["target"]  # its draft is scripted to say nothing: the session stays open

    async def scenario():
        owner, intruder = Stream(target.address, "target"), Stream(target.address, "target")
        owner.send(request("target", start=start("mine")))
        await wait_for(lambda: "mine" in target.sessions)
        intruder.send(request("target", cancel=pb.Cancel(session_id="mine")))
        cancelled = await intruder.read()
        intruder.send(request("target", start=start("mine")))  # a duplicate start, from elsewhere
        duplicate = await intruder.read()
        owner.send(request("target", start=start("mine")))  # and from the owner itself
        own_duplicate = await owner.read()
        assert "mine" in target.sessions  # the original session is intact
        owner.send(request("target", cancel=pb.Cancel(session_id="mine")))
        finished = await owner.read()
        await intruder.close()
        await owner.close()
        return cancelled, duplicate, own_duplicate, finished

    cancelled, duplicate, own_duplicate, finished = loop.run_until_complete(scenario())
    for event, words in ((cancelled, "no session 'mine' on this stream"), (duplicate, "already exists"),
                         (own_duplicate, "already exists")):
        assert event.error.code == INVALID and words in event.error.message
    assert finished.finished.finish_reason == "cancelled"


def test_an_empty_message_is_invalid_argument_and_the_stream_goes_on(services, loop):
    async def scenario():
        out = []
        for role in ("target", "draft"):
            stream = Stream(services[role].address, role)
            stream.send(request(role))
            empty = await stream.read()
            stream.send(request(role, start=start("after-empty", policy="none" if role == "target" else "constant")))
            answer = await stream.read()
            await stream.close()
            out.append((role, empty, answer))
        return out

    for role, empty, answer in loop.run_until_complete(scenario()):
        assert empty.error.code == INVALID and "empty message" in empty.error.message, role
        assert answer.WhichOneof("kind") in ("settled", "block"), (role, answer)


def block(session_id: str, base: int, tokens) -> pb.Block:
    return pb.Block(session_id=session_id, base=base, tokens=list(tokens))


@pytest.mark.parametrize("crafted, words", [
    (block("bad-0", 3, [1] * 5), "past the session's 8 tokens"),
    (block("bad-1", 3, [1] * 9), "the cap is 8"),
    (block("bad-2", 3, [1] * 500), "the cap is 8"),
    (block("bad-3", 3, [10**6]), "drafted token id 1000000 is outside the vocabulary"),
    (block("bad-4", 3, [-1]), "drafted token id -1 is outside the vocabulary"),
    (block("bad-5", 7, [1]), "a block at base 7, committed 3"),
    (pb.Block(session_id="bad-6", base=3, tokens=[1] * 8, grows=1), "grew a block of 1 tokens by 8"),
    (pb.Block(session_id="bad-7", base=3, tokens=[10**6], grows=1), "drafted token id 1000000 is outside"),
    # timed past any clock: a draft's timings feed auto's price (wire_checks.MAX_TIMING_S)
    (pb.Block(session_id="bad-9", base=3, tokens=[1], finished_at=1e13), "whose finished_at is 10000000000000.0"),
    # unreadable as a block at all (read on the target's event loop, not its compute thread)
    (pb.Block(session_id="bad-8", base=3, tokens=[1, 1], q_probs=convert.floats_to_proto([0.5])),
     "block of 2 tokens carries 1 probabilities"),
])
def test_the_target_refuses_draft_blocks_past_its_limits(services, loop, crafted, words, caplog):
    """A draft worker that misbehaves (or a peer posing as one) cannot make the target verify
    past the context, the budget or the cap, nor feed it ids outside the vocabulary: its block is
    refused, the draft given up for the session, and the session goes on alone (no caller error)."""
    services["fake"].script[crafted.session_id] = [crafted]

    async def scenario():
        stream = Stream(services["target"].address, "target")
        stream.send(request("target", start=start(crafted.session_id, max_new_tokens=5)))
        event = await stream.read()
        await stream.close()
        return event

    with caplog.at_level(logging.WARNING):
        event = loop.run_until_complete(scenario())
    # the draft is given up for the session, which the target finishes alone: never verified past a limit
    assert event.WhichOneof("kind") == "settled" and len(event.settled.tokens) <= 5, event
    assert words in caplog.text and "going on without the draft" in caplog.text


def test_a_draft_message_that_breaks_its_reader_fails_its_session_not_the_link(services, loop, caplog,
                                                                                monkeypatch):
    """The target reads the draft's messages on its event loop; a message whose reading raises
    anything (here a reader's bug, injected for one session) gives the draft up for that session
    alone: the link stays, and the next session's block still reaches its checks through it."""
    from coordinator.session import host

    real = host.convert.draft_event_from_proto

    def buggy(event, width=None):
        if event.block.session_id == "bug-1":
            raise ValueError("a reader's bug")
        return real(event, width)

    monkeypatch.setattr(host.convert, "draft_event_from_proto", buggy)
    services["fake"].script["bug-1"] = [block("bug-1", 3, [1])]
    services["fake"].script["bug-2"] = [block("bug-2", 3, [1] * 9)]

    async def scenario():
        stream = Stream(services["target"].address, "target")
        finished = {}
        for session_id in ("bug-1", "bug-2"):
            stream.send(request("target", start=start(session_id, max_new_tokens=5)))
            while session_id not in finished:  # each session's events to its end
                event = await stream.read()
                kind = event.WhichOneof("kind")
                assert kind in ("settled", "finished"), event
                if kind == "finished":
                    finished[event.finished.session_id] = event.finished
        await stream.close()
        return finished

    with caplog.at_level(logging.WARNING):
        finished = loop.run_until_complete(scenario())
    assert set(finished) == {"bug-1", "bug-2"}  # both went on, alone, to their ends
    assert "could not be read" in caplog.text and "the cap is 8" in caplog.text  # bug-2's block came through
    assert "draft link" not in caplog.text and services["target"].draft.available


@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("msg, words", [
    (start("ctx", prompt=range(1, 40), max_new_tokens=30), "exceeds the model's context of 64"),
    (start("big", max_new_tokens=2**31 - 1), "exceeds the model's context of 64"),
    (start("ids", prompt=(1, 10**6)), "prompt token id 1000000 is outside"),
    (start("empty", prompt=()), "prompt is empty"),
])
def test_starts_past_the_limits_are_refused(services, loop, role, msg, words):
    async def scenario():
        stream = Stream(services[role].address, role)
        stream.send(request(role, start=msg))
        event = await stream.read()
        await stream.close()
        return event

    event = loop.run_until_complete(scenario())
    assert event.error.code == INVALID and words in event.error.message


def test_the_draft_refuses_a_cap_past_the_deployments(services, loop):
    async def scenario():
        stream = Stream(services["draft"].address, "draft")
        stream.send(request("draft", start=start("long", max_draft_length=500)))
        event = await stream.read()
        await stream.close()
        return event

    event = loop.run_until_complete(scenario())
    assert event.error.code == INVALID and "max draft length must be in [1, 8]" in event.error.message


def test_the_draft_checks_the_targets_feedback_token(services, loop, limits):
    async def scenario():
        stream = Stream(services["draft"].address, "draft")
        stream.send(pb.DraftRequest(start=start("fb")))
        block = (await stream.read()).block
        stream.send(pb.DraftRequest(feedback=pb.Feedback(session_id="fb", epoch=1, base=block.base,
                                                         drafted=len(block.tokens), accepted=0, token=limits.tokens)))
        event = await stream.read()
        await stream.close()
        return event

    event = loop.run_until_complete(scenario())
    assert event.error.code == INVALID and f"feedback token id {limits.tokens} is outside" in event.error.message


def _refused_beside_a_neighbour(services, loop, bad_feedback, **good_fields) -> pb.Error:
    """Two sessions start; one step's batch carries a well-formed feedback for "good" (accepting
    its block whole, with ``good_fields``) and bad_feedback(bad block) for "bad". The neighbour's
    next block comes; returns the one error, which is "bad"'s alone."""
    async def scenario():
        stream = Stream(services["draft"].address, "draft")
        stream.send(pb.DraftRequest(start=start("good")))
        stream.send(pb.DraftRequest(start=start("bad")))
        blocks = {}
        while len(blocks) < 2:
            for e in events_of(await stream.read()):
                blocks[e.block.session_id] = e.block
        good = blocks["good"]
        ok = pb.Feedback(session_id="good", epoch=0, base=good.base, drafted=len(good.tokens),
                         accepted=len(good.tokens), token=5, **good_fields)
        batch = [pb.DraftRequest(feedback=m).SerializeToString() for m in (ok, bad_feedback(blocks["bad"]))]
        stream.send(pb.DraftRequest(batch=batch))
        events = []
        while not (any(e.WhichOneof("kind") == "error" for e in events)
                   and any(e.WhichOneof("kind") == "block" for e in events)):
            events += events_of(await stream.read())
        await stream.close()
        return good, events

    good, events = loop.run_until_complete(scenario())
    [error] = [e.error for e in events if e.WhichOneof("kind") == "error"]
    [block] = [e.block for e in events if e.WhichOneof("kind") == "block"]
    assert error.session_id == "bad" and error.code == INVALID
    assert block.session_id == "good" and block.base == good.base + len(good.tokens) + 1
    return error


def test_a_malformed_verdict_late_in_a_chain_fails_its_session_alone_in_a_batch(services, loop):
    """One step's batch carries a well-formed feedback for one session and, for another, a chain
    whose second verdict has a malformed stop rule: that session is refused (read whole before any
    verdict of it is applied), its neighbour's verdict is applied and its next block comes."""
    _refused_beside_a_neighbour(services, loop, lambda bad: pb.Feedback(
        session_id="bad", epoch=0, base=bad.base, drafted=len(bad.tokens), accepted=0, token=5,
        then=pb.Feedback(session_id="bad", stop_rule=pb.StopRule(weights=[1.0]))))


def test_a_follow_up_count_on_a_settled_verdict_fails_its_session_alone_in_a_batch(services, loop):
    """Outcome.next_tokens (how much of a grown follow-up the target verifies) belongs to a
    follow-up's verdict only: a feedback that gives it with a settled token is INVALID_ARGUMENT for
    its session, and its neighbour in the same batch gets its next block."""
    error = _refused_beside_a_neighbour(services, loop, lambda bad: pb.Feedback(
        session_id="bad", epoch=0, base=bad.base, drafted=len(bad.tokens), accepted=len(bad.tokens), token=5,
        next=pb.NEXT_SETTLED, next_tokens=3), next=pb.NEXT_SETTLED)
    assert "follow-up" in error.message


def test_a_stream_that_goes_away_frees_its_sessions(services, loop):
    async def scenario():
        streams = [Stream(services[role].address, role) for role in ("target", "draft") for _ in range(3)]
        for i, stream in enumerate(streams):
            msg = start(f"gone-{i}")
            stream.send(request("target" if i < 3 else "draft", start=msg))
        workers = (services["target"], services["draft"])
        await wait_for(lambda: sum(s.startswith("gone-") for svc in workers for s in svc.sessions) == 6)
        for stream in streams:
            await stream.close()
        await wait_for(lambda: not any(s.startswith("gone-") for svc in workers for s in svc.sessions))

    loop.run_until_complete(scenario())


class Chatty(SessionService):
    """A service of the real interface whose every request makes ten events."""

    role = "chatty"

    def __init__(self, compute=ComputeLoop):
        super().__init__(Limits(tokens=10, positions=None), compute)
        self.made = 0

    async def Session(self, request_iterator, context):
        async for event in self._serve_stream(request_iterator):
            yield event

    def handle(self, request, stream, received_at):
        for _ in range(10):
            self.made += 1
            stream.emit(request)

    def error_event(self, session_id, code, message):
        return pb.DraftEvent(error=pb.Error(session_id=session_id, code=code.value[0], message=message))


def test_a_peer_that_stops_reading_stops_the_worker_producing(loop):
    """Events wait in a bounded queue: a peer that reads nothing holds the stream, not memory."""
    async def scenario():
        service = Chatty()

        async def requests():
            for i in range(1000):
                yield pb.DraftRequest(cancel=pb.Cancel(session_id=str(i)))

        events = service.Session(requests(), None)
        await events.__anext__()
        await wait_for(lambda: service.made >= MAX_QUEUED_EVENTS)  # it produced until the queue was full...
        for _ in range(2000):  # ...then as many loop turns as an unbounded reader needs for all 1,000 requests
            await asyncio.sleep(0)
        assert await service._compute_answers(60)  # and everything it read has been handled
        made = service.made
        await events.aclose()
        return made

    made = loop.run_until_complete(scenario())
    assert made <= 10 * MAX_QUEUED_EVENTS  # of the 10,000 the requests ask for (10 events a request)


def test_events_on_their_way_to_the_queue_count_against_the_backlog(loop):
    """The compute thread's events reach the stream's queue only when the event loop turns; a
    thread that handles requests while the loop reads more (a loaded machine) must not read as
    room. Held by hand here: every request read is handled before the next is read, and the loop
    never turns in between, so no event reaches the queue until the reader stops."""
    async def scenario():
        service = Chatty(ManualLoop)

        async def requests():
            for i in range(1000):
                while service.compute.inbox:
                    service.compute.run_one()
                yield pb.DraftRequest(cancel=pb.Cancel(session_id=str(i)))

        events = service.Session(requests(), None)
        await events.__anext__()
        for _ in range(2000):
            await asyncio.sleep(0)
        made = service.made
        await events.aclose()
        return made

    assert loop.run_until_complete(scenario()) <= MAX_QUEUED_EVENTS + 10  # one request's events past the bound


def events_of(message: pb.DraftEvent) -> list[pb.DraftEvent]:
    """The events one message from the draft worker carries (a step's batch, or itself)."""
    from svip_runtime.wire_batch import unpack

    return [event for event, _ in unpack(message, pb.DraftEvent)]


def test_a_batch_is_handled_request_by_request_and_a_bad_one_is_invalid_argument(services, loop):
    """One message carrying a step's requests (svip_runtime/wire_batch.py) is handled as if each had
    come alone, in order; a batch that cannot be taken apart is refused whole, in one error, and the
    stream goes on."""
    from svip_runtime.wire_batch import MAX_BATCH

    def batch(*items: bytes) -> pb.DraftRequest:
        return pb.DraftRequest(batch=list(items))

    first, second = (pb.DraftRequest(start=start(f"batched-{i}")).SerializeToString() for i in range(2))
    bad = [
        (pb.DraftRequest(cancel=pb.Cancel(session_id="x"), batch=[first]), "a batch sets no kind"),
        (batch(batch(first).SerializeToString()), "a batch inside a batch"),
        (batch(b"\xff\xff\xff"), "a batch item is not a DraftRequest"),
        (batch(*[first] * (MAX_BATCH + 1)), f"a batch holds at most {MAX_BATCH} messages"),
    ]

    async def scenario():
        stream = Stream(services["draft"].address, "draft")
        stream.send(batch(first, second))
        blocks = []
        while len(blocks) < 2:
            blocks += [e for e in events_of(await stream.read()) if e.WhichOneof("kind") == "block"]
        refusals = []
        for message, _ in bad:
            stream.send(message)
            refusals.append(events_of(await stream.read()))
        stream.send(request("draft", start=start("after-bad-batches")))
        after = events_of(await stream.read())
        await stream.close()
        return blocks, refusals, after

    blocks, refusals, after = loop.run_until_complete(scenario())
    assert sorted(b.block.session_id for b in blocks) == ["batched-0", "batched-1"]
    for (_, words), events in zip(bad, refusals):
        assert len(events) == 1 and events[0].error.code == INVALID and words in events[0].error.message, events
    assert after[0].block.session_id == "after-bad-batches"


def test_a_steps_messages_travel_as_one_each_way(models, prompt_ids, loop):
    """Eight concurrent async sessions: the target's feedback for a step's sessions goes to the draft
    as one message, the draft's blocks for a step's sessions come back as one, and every output is
    the target alone's."""
    from coordinator.engine import SpeculativeEngine
    from svip_common.contracts import GenerationRequest, PolicyConfig
    from tests.workers import generate_through, in_process_workers

    target = models["target"]
    prompts = list(prompt_ids.values())
    requests = [GenerationRequest(prompts[i % len(prompts)] + (i,), 24, ignore_eos=True,
                                  policy=PolicyConfig(name="constant", draft_length=3)) for i in range(8)]
    alone = SpeculativeEngine(target, None)
    expected = [alone.generate(r).token_ids for r in requests]
    with in_process_workers(loop, models, load_aware="off") as w:
        results = generate_through(loop, w, target.path, "async", requests)
        to_draft, from_draft = w.host.draft.link.sent_batches, w.draft.sent_batches
    assert [r.token_ids for r in results] == expected
    assert to_draft > 0 and from_draft > 0, (to_draft, from_draft)


def test_a_malformed_batch_from_the_draft_loses_the_draft_not_the_session(models, limits, loop, caplog):
    """The target worker cannot take a draft's batch apart: the link counts as broken (the draft is
    lost, as a crashed one), and the session goes on with the target alone, its output exact."""
    from coordinator.engine import SpeculativeEngine
    from coordinator.session.host import SessionHost
    from svip_common.contracts import GenerationRequest, PolicyConfig

    fake = FakeDraft()
    fake.raw["bad-batch"] = [pb.DraftEvent(batch=[b"\xff\xff\xff"])]
    server, port = loop.run_until_complete(
        start_server(lambda s: pb_grpc.add_DraftWorkerServicer_to_server(fake, s), "svip.v1.Test"))
    host = SessionHost(Verifier(models["target"], limits.tokens), limits,
                       PairConfig("target", "draft", load_aware="off"), f"127.0.0.1:{port}")
    loop.run_until_complete(host.start())
    target_server, target_port = loop.run_until_complete(
        start_server(lambda s: pb_grpc.add_TargetWorkerServicer_to_server(host, s), "svip.v1.Test"))

    async def scenario():
        stream = Stream(f"127.0.0.1:{target_port}", "target")
        stream.send(request("target", start=start("bad-batch", max_new_tokens=6)))
        tokens = []
        while (event := await stream.read()).WhichOneof("kind") == "settled":
            tokens += event.settled.tokens
        await stream.close()
        return tokens, event

    try:
        with caplog.at_level(logging.WARNING):
            tokens, last = loop.run_until_complete(scenario())
    finally:
        loop.run_until_complete(host.close())
        for s in (target_server, server):
            loop.run_until_complete(s.stop(None))
    alone = SpeculativeEngine(models["target"], None).generate(
        GenerationRequest((5, 6, 7), 6, policy=PolicyConfig(name="none"))).token_ids
    assert last.WhichOneof("kind") == "finished" and tokens == list(alone)
    assert "sent a malformed batch (a batch item is not a DraftEvent)" in caplog.text


def test_a_sampled_rejection_by_its_ids_with_mass_draws_what_the_full_row_draws_and_a_bad_one_is_refused(
        services, loop, limits):
    """Two sessions alike (prompt, seed) get the same rejection: one with the target's p row whole,
    one by its ids with mass (p_nonzero, as a top-p row travels); the draft draws the same
    correction and drafts the same next block. A malformed sparse row is INVALID_ARGUMENT, and the
    stream goes on."""
    from svip_proto import convert

    width = services["draft"].drafter.width
    p = torch.zeros(width)
    p[[3, 10, 20, 50]] = torch.tensor([0.4, 0.3, 0.2, 0.1])

    def sampled(session_id: str) -> pb.DraftRequest:
        msg = start(session_id)
        msg.sampling.CopyFrom(pb.SamplingParams(temperature=1.0, top_p=0.9, seed=11))
        return pb.DraftRequest(start=msg)

    def rejection(session_id: str, block: pb.Block) -> pb.Feedback:
        return pb.Feedback(session_id=session_id, epoch=1, base=block.base, drafted=len(block.tokens), accepted=0,
                           token=-1)

    async def next_block(stream) -> pb.Block:
        while True:
            for event in events_of(await stream.read()):
                if event.WhichOneof("kind") == "block":
                    return event.block
                assert event.WhichOneof("kind") != "error", event

    async def scenario():
        stream = Stream(services["draft"].address, "draft")
        firsts = {}
        for session_id in ("whole-row", "ids-with-mass"):
            stream.send(sampled(session_id))
            firsts[session_id] = await next_block(stream)
        dense = rejection("whole-row", firsts["whole-row"])
        dense.p_row.CopyFrom(convert.tensor_to_proto(p))
        sparse = rejection("ids-with-mass", firsts["ids-with-mass"])
        convert.p_row_to_proto(sparse, p)
        nexts = {}
        for session_id, feedback in (("whole-row", dense), ("ids-with-mass", sparse)):
            stream.send(pb.DraftRequest(feedback=feedback))
            nexts[session_id] = await next_block(stream)
        stream.send(sampled("bad-row"))
        bad = rejection("bad-row", await next_block(stream))
        bad.p_nonzero.ids.CopyFrom(convert.tensor_to_proto(torch.tensor([3, width], dtype=torch.int32)))
        bad.p_nonzero.values.CopyFrom(convert.tensor_to_proto(torch.tensor([0.5, 0.5])))
        stream.send(pb.DraftRequest(feedback=bad))
        refusal = events_of(await stream.read())
        stream.send(request("draft", start=start("after-a-bad-row")))
        after = await next_block(stream)
        await stream.close()
        return firsts, sparse, nexts, refusal, after

    firsts, sparse, nexts, refusal, after = loop.run_until_complete(scenario())
    assert sparse.HasField("p_nonzero") and not sparse.HasField("p_row")
    assert list(firsts["whole-row"].tokens) == list(firsts["ids-with-mass"].tokens)
    whole, by_ids = nexts["whole-row"], nexts["ids-with-mass"]
    assert whole.HasField("resolved_token") and whole.resolved_token in (3, 10, 20, 50)
    assert (whole.resolved_token, whole.base, list(whole.tokens)) == (by_ids.resolved_token, by_ids.base,
                                                                     list(by_ids.tokens))
    assert len(refusal) == 1 and refusal[0].error.code == INVALID
    assert f"p_nonzero ids must be ascending, each in [0, {width})" in refusal[0].error.message
    assert after.session_id == "after-a-bad-row"
