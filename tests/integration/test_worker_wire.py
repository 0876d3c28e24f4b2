"""The workers do not trust the wire: real gRPC on loopback against the draft and target services
(hosted here, without Ray). A session belongs to the stream that opened it, a duplicate start
leaves the original alone, an empty message is INVALID_ARGUMENT, blocks past the context or the
session's budget or the cap are refused, ids past the draft's embedding never reach it, and a
stream's sessions are freed when it goes away."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from draft_worker.drafter import Drafter
from draft_worker.service import DraftService
from svip_common.contracts import Limits
from svip_common.grpc_server import MAX_QUEUED_EVENTS, SessionService, start_server
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from target_worker.service import TargetService
from target_worker.verifier import Verifier

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def limits(models):
    # the tiny target has 512 positions; this deployment serves 64, and blocks of at most 8
    return Limits(tokens=models["target"].token_limit, positions=64, max_draft_length=8)


@pytest.fixture(scope="module")
def services(models, limits, loop):
    target = TargetService(Verifier(models["target"], limits.tokens), limits)
    draft = DraftService(Drafter(models["close_draft"], models["target"].vocab_size, limits.tokens), limits)
    servers = []
    for service, add in ((target, pb_grpc.add_TargetWorkerServicer_to_server), (draft, pb_grpc.add_DraftWorkerServicer_to_server)):
        server, port = loop.run_until_complete(start_server(lambda s, svc=service, a=add: a(svc, s), "svip.v1.Test"))
        servers.append(server)
        service.address = f"127.0.0.1:{port}"
    yield {"target": target, "draft": draft}
    for server in servers:
        loop.run_until_complete(server.stop(None))


class Stream:
    """One raw bidirectional stream to a worker, driven by hand."""

    def __init__(self, address: str, role: str):
        self.channel = grpc.aio.insecure_channel(address)
        stub = pb_grpc.TargetWorkerStub(self.channel) if role == "target" else pb_grpc.DraftWorkerStub(self.channel)
        self.requests: asyncio.Queue = asyncio.Queue()
        self.call = stub.Session(self._gen())

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


def start(session_id: str, prompt=(5, 6, 7), max_new_tokens: int = 20, **policy) -> pb.StartSession:
    msg = pb.StartSession(session_id=session_id, prompt_ids=list(prompt), max_new_tokens=max_new_tokens,
                          sampling=pb.SamplingParams(top_p=1.0), pipeline=pb.PIPELINE_SYNC)
    msg.policy.CopyFrom(pb.PolicyConfig(name="constant", threshold=0.3, entropy_scale=0.15, draft_length=3,
                                        max_draft_length=policy.get("max_draft_length", 8), confidence=0.4))
    return msg


def verify(session_id: str, base: int, tokens=(), append=()) -> pb.TargetRequest:
    return pb.TargetRequest(verify=pb.VerifyBlock(block=pb.Block(session_id=session_id, base=base, tokens=list(tokens)),
                                                  append=list(append)))


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)


def test_a_session_belongs_to_the_stream_that_opened_it(services, loop):
    target = services["target"]

    async def scenario():
        owner, intruder = Stream(target.address, "target"), Stream(target.address, "target")
        owner.send(pb.TargetRequest(start=start("mine")))
        await wait_for(lambda: "mine" in target.sessions)
        intruder.send(verify("mine", 3))
        stolen = await intruder.read()
        intruder.send(pb.TargetRequest(cancel=pb.Cancel(session_id="mine")))
        cancelled = await intruder.read()
        intruder.send(pb.TargetRequest(start=start("mine")))  # a duplicate start, from elsewhere
        duplicate = await intruder.read()
        owner.send(pb.TargetRequest(start=start("mine")))  # and from the owner itself
        own_duplicate = await owner.read()
        owner.send(verify("mine", 3))  # the original session is intact
        verdict = await owner.read()
        await intruder.close()
        await owner.close()
        return stolen, cancelled, duplicate, own_duplicate, verdict

    stolen, cancelled, duplicate, own_duplicate, verdict = loop.run_until_complete(scenario())
    for event, words in ((stolen, "no session 'mine' on this stream"), (cancelled, "no session 'mine' on this stream"),
                         (duplicate, "already exists"), (own_duplicate, "already exists")):
        assert event.error.code == INVALID and words in event.error.message
    assert verdict.WhichOneof("kind") == "verdict" and verdict.verdict.base == 3


def test_an_empty_message_is_invalid_argument_and_the_stream_goes_on(services, loop):
    async def scenario():
        for role in ("target", "draft"):
            stream = Stream(services[role].address, role)
            stream.send(pb.TargetRequest() if role == "target" else pb.DraftRequest())
            empty = await stream.read()
            request = pb.TargetRequest(start=start("after-empty")) if role == "target" else pb.DraftRequest(start=start("after-empty"))
            stream.send(request)
            if role == "target":
                stream.send(verify("after-empty", 3))
            answer = await stream.read()
            await stream.close()
            yield role, empty, answer

    async def collect():
        return [x async for x in scenario()]

    for role, empty, answer in loop.run_until_complete(collect()):
        assert empty.error.code == INVALID and "empty message" in empty.error.message, role
        assert answer.WhichOneof("kind") in ("verdict", "block"), (role, answer)


@pytest.mark.parametrize("request_, words", [
    (verify("budget", 3, tokens=[1] * 5), "reaches past the session's 8 tokens"),
    (verify("budget", 3, tokens=[1] * 9), "exceeds the cap of 8"),
    (verify("budget", 3, tokens=[1] * 500), "exceeds the cap of 8"),
    (verify("budget", 4, append=[10**6]), "outside the vocabulary"),
    (verify("budget", 3, tokens=[-1]), "outside the vocabulary"),
])
def test_the_target_refuses_blocks_past_its_limits(services, loop, request_, words):
    async def scenario():
        stream = Stream(services["target"].address, "target")
        stream.send(pb.TargetRequest(start=start("budget", max_new_tokens=5)))
        stream.send(request_)
        event = await stream.read()
        await stream.close()
        return event

    event = loop.run_until_complete(scenario())
    assert event.error.code == INVALID and words in event.error.message


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
        stream.send(pb.TargetRequest(start=msg) if role == "target" else pb.DraftRequest(start=msg))
        if role == "target":  # a target start answers nothing until a block comes
            stream.send(verify(msg.session_id, len(msg.prompt_ids)))
        event = await stream.read()
        await stream.close()
        return event

    event = loop.run_until_complete(scenario())
    assert event.error.code == INVALID and words in event.error.message


def test_the_draft_refuses_a_cap_past_the_deployments(services, loop):
    async def scenario():
        stream = Stream(services["draft"].address, "draft")
        stream.send(pb.DraftRequest(start=start("long", max_draft_length=500)))
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


def test_a_stream_that_goes_away_frees_its_sessions(services, loop):
    async def scenario():
        streams = [Stream(services[role].address, role) for role in ("target", "draft") for _ in range(3)]
        for i, stream in enumerate(streams):
            msg = start(f"gone-{i}")
            stream.send(pb.TargetRequest(start=msg) if i < 3 else pb.DraftRequest(start=msg))
        await wait_for(lambda: sum(s.startswith("gone-") for svc in services.values() for s in svc.sessions) == 6)
        for stream in streams:
            await stream.close()
        await wait_for(lambda: not any(s.startswith("gone-") for svc in services.values() for s in svc.sessions))

    loop.run_until_complete(scenario())


class Chatty(SessionService):
    """A service of the real interface whose every request makes ten events."""

    role = "chatty"

    def __init__(self):
        super().__init__(Limits(tokens=10, positions=None))
        self.made = 0

    def handle(self, request, owner):
        for _ in range(10):
            self.made += 1
            yield request

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
        await asyncio.sleep(0.5)
        made = service.made
        await events.aclose()
        return made

    made = loop.run_until_complete(scenario())
    assert made <= MAX_QUEUED_EVENTS + 20  # of the 10,000 the requests ask for
