"""The draft link's byte budget (issue 40; the security review's N2): a feature head's first
feedback after a long prompt, or one step's many feedbacks, used to go as one message past gRPC's
64 MiB, and the stream ended for every session on the replica. Now a step's messages are packed
only up to MAX_BURST_BYTES and target features leave ahead of their message in FeatureChunks of
FEATURE_CHUNK_BYTES: on real gRPC on loopback, the target side's real DraftLink to a draft
servicer that takes the messages apart as the draft worker does (wire_batch.unpack) and joins
the chunks with the draft worker's own FeatureChunks, at a realistic width."""

from __future__ import annotations

import asyncio

import pytest
import torch

from coordinator.session.draft_link import DraftLink
from draft_worker.service import FeatureChunks
from svip_common.errors import InvalidRequest
from svip_common.messages import Feedback
from svip_common.outcome import SETTLED, Outcome
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from svip_runtime.grpc_server import MAX_MESSAGE_BYTES, start_server
from svip_runtime.wire_batch import MAX_BURST_BYTES, unpack

LLAMA_8B_FEATURES = 3 * 4096  # EAGLE-3's three hidden states at Llama-3.1-8B's width
PROMPT = 4096


class JoiningDraft(pb_grpc.DraftWorkerServicer):
    """Takes every message apart as the draft worker does, joins feature chunks with its
    FeatureChunks, and answers a Closed for each Feedback (so the test knows it arrived)."""

    def __init__(self):
        self.sizes: list[int] = []  # each message's bytes on the wire
        self.features: dict[str, tuple[torch.Tensor, int]] = {}  # a feedback's features, joined, and its first
        self.chunks = FeatureChunks(rows=1 << 20)

    async def Session(self, request_iterator, context):
        async for message in request_iterator:
            self.sizes.append(message.ByteSize())
            for request, _ in unpack(message, pb.DraftRequest):
                kind = request.WhichOneof("kind")
                if kind == "feature_chunk":
                    chunk = request.feature_chunk
                    self.chunks.add(chunk.session_id, chunk.features_from,
                                    convert.tensor_from_proto(chunk.features))
                elif kind == "feedback":
                    fb = request.feedback
                    features, first = convert.tensor_from_proto(fb.features), fb.features_from
                    if (ahead := self.chunks.take(fb.session_id)) is not None:
                        features, first = ahead.joined(features, first)
                    self.features[fb.session_id] = (features, first)
                    yield pb.DraftEvent(closed=pb.Closed(session_id=fb.session_id))


def feedback(session_id: str, features: torch.Tensor) -> Feedback:
    n = features.shape[0]
    return Feedback(session_id=session_id, outcome=Outcome(1, n - 3, 4, 3, 7, SETTLED),
                    features=features, features_from=0)


def send_through_link(loop, requests: list[Feedback]) -> tuple[JoiningDraft, str | None]:
    """The requests on one real DraftLink, all at once (one step's); the servicer and whether the
    link broke."""
    draft = JoiningDraft()

    async def run():
        server, port = await start_server(lambda s: pb_grpc.add_DraftWorkerServicer_to_server(draft, s),
                                          "svip.v1.Test")
        closed, broken = asyncio.Event(), []
        answered = []

        def on_event(event, received_at, size):
            answered.append(event.closed.session_id)
            if len(answered) == len(requests):
                closed.set()

        link = DraftLink(f"127.0.0.1:{port}", on_event, lambda why: (broken.append(why), closed.set()))
        await link.open()
        try:
            for request in requests:
                for message in convert.draft_request_to_wire(request):
                    link.send(request.session_id, message.SerializeToString())
            await asyncio.wait_for(closed.wait(), 600)  # bounds a failure only
        finally:
            await link.close()
            await server.stop(None)
        return broken[0] if broken else None

    return draft, loop.run_until_complete(run())


def test_a_long_prompts_features_at_llama_8b_width_cross_in_chunks(loop):
    """4,096 positions x 3 x 4096 bf16 = 100 MB of features in one verdict (past 2,731 positions
    it broke the link): every message under the budget, the features joined bit for bit."""
    features = torch.randn(PROMPT, LLAMA_8B_FEATURES).to(torch.bfloat16)
    draft, broken = send_through_link(loop, [feedback("long", features)])
    assert broken is None
    joined, first = draft.features["long"]
    assert first == 0 and torch.equal(joined.view(torch.int16), features.view(torch.int16))
    assert max(draft.sizes) <= MAX_BURST_BYTES + convert.FEATURE_CHUNK_BYTES + 4096
    assert len(draft.sizes) >= features.numel() * 2 // (MAX_BURST_BYTES + convert.FEATURE_CHUNK_BYTES)


def test_one_steps_many_medium_feedbacks_cross_in_several_messages(loop):
    """The review's run: twelve 6 MiB feedbacks sent in one burst were packed into one 75.5 MB
    message and the stream ended. Now they go in batches under the budget, each session's
    features whole."""
    rows = (6 << 20) // (LLAMA_8B_FEATURES * 2)
    sent = {f"s{i}": torch.randn(rows, LLAMA_8B_FEATURES).to(torch.bfloat16) for i in range(12)}
    draft, broken = send_through_link(loop, [feedback(sid, f) for sid, f in sent.items()])
    assert broken is None and set(draft.features) == set(sent)
    assert all(torch.equal(draft.features[sid][0].view(torch.int16), f.view(torch.int16)) for sid, f in sent.items())
    assert max(draft.sizes) < MAX_MESSAGE_BYTES // 2


def test_feature_chunks_must_continue_each_other_and_fit_the_context():
    chunks = FeatureChunks(rows=10)
    chunks.add("s", 0, torch.zeros(4, 2))
    with pytest.raises(InvalidRequest, match="chunks before it end at 3"):
        chunks.add("s", 5, torch.zeros(1, 2))  # a gap
    with pytest.raises(InvalidRequest, match="more than 10 positions"):
        chunks.add("s", 4, torch.zeros(7, 2))
    assert chunks.take("s") is None  # refused past the context: what it held is dropped
    chunks.add("t", 3, torch.zeros(2, 2))
    with pytest.raises(InvalidRequest, match="the chunks sent ahead end at 4"):
        chunks.take("t").joined(torch.zeros(1, 2), 6)


def test_small_features_travel_in_their_message_and_large_ones_split_on_row_bounds():
    small = feedback("s", torch.zeros(8, 16))
    assert [m.WhichOneof("kind") for m in convert.draft_request_to_wire(small)] == ["feedback"]
    rows = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4)
    messages = convert.draft_request_to_wire(feedback("s", rows), chunk_bytes=3 * 16)  # three rows a chunk
    assert [m.WhichOneof("kind") for m in messages] == ["feature_chunk"] * 3 + ["feedback"]
    assert [m.feature_chunk.features_from for m in messages[:3]] == [0, 3, 6]
    assert messages[-1].feedback.features_from == 9 and list(messages[-1].feedback.features.shape) == [1, 4]


def test_a_resume_after_a_long_pause_sends_its_features_ahead_in_chunks():
    """A Resume carries the features of every token settled during a load-aware pause: over the
    chunk size they go ahead too, and the draft joins them before the Resume's own rows."""
    from svip_common.messages import Resume

    rows = torch.arange(7 * 4, dtype=torch.float32).reshape(7, 4)
    resume = Resume(session_id="s", epoch=2, base=10, tokens=tuple(range(8)), load_cap=4, features=rows,
                    features_from=10)
    messages = convert.draft_request_to_wire(resume, chunk_bytes=2 * 16)
    assert [m.WhichOneof("kind") for m in messages] == ["feature_chunk"] * 3 + ["resume"]
    chunks = FeatureChunks(rows=100)
    for m in messages[:3]:
        chunks.add("s", m.feature_chunk.features_from, convert.tensor_from_proto(m.feature_chunk.features))
    last = messages[-1].resume
    joined, first = chunks.take("s").joined(convert.tensor_from_proto(last.features), last.features_from)
    assert first == 10 and torch.equal(joined, rows)
