"""What a direct peer of a worker's gRPC can and cannot take (the security review's M1), on a real
draft service and a real session host serving gRPC on loopback, hosted here without Ray: a
plaintext bind off loopback is refused; a peer that opens 10,000 sessions is refused past the cap
per stream while sessions of other streams speculate and stay exact; the target admits sessions by
KV room and refuses only the one that does not fit (RESOURCE_EXHAUSTED), never the others of a
step; the distributed batch admits by KV as the in-process batch does."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.distributed import DistributedEngine
from coordinator.engine import SpeculativeEngine
from coordinator.local import run_admitted
from svip_common.contracts import GenerationRequest, PolicyConfig
from svip_common.errors import InvalidRequest
from svip_common.models import load_model_info
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from svip_runtime.grpc_server import MAX_SESSIONS_PER_STREAM, check_bind, start_server
from svip_runtime.wire_batch import unpack
from tests.gates import async_wait_until
from tests.tls_certs import make_tls_dir
from tests.workers import in_process_workers

TARGET_POOL_TOKENS = 256  # 16 pages of 16 tokens
PEER_SESSIONS = 10_000
CONSTANT = PolicyConfig(name="constant", draft_length=4)


@pytest.fixture(scope="module")
def workers(models, loop):
    with in_process_workers(loop, models, target_kv_tokens=TARGET_POOL_TOKENS, load_aware="off") as w:
        yield w


@pytest.fixture(scope="module")
def engine(workers, model_dirs, loop):
    engine = DistributedEngine(load_model_info(model_dirs.target), workers.limits, workers.target_address,
                               workers.draft_address, "async")
    loop.run_until_complete(engine.connect())
    yield engine
    loop.run_until_complete(engine.close())


def alone(models, request):
    return SpeculativeEngine(models["target"], None).generate(request).token_ids


@pytest.mark.parametrize("host", ["192.0.2.10", "10.0.0.1", "::ffff:c000:20a"])
def test_a_plaintext_bind_off_loopback_is_refused(host, loop, tmp_path):
    with pytest.raises(InvalidRequest, match="refusing to serve worker gRPC in plaintext on .*--insecure-workers"):
        loop.run_until_complete(start_server(lambda server: None, "svip.v1.Test", host))
    check_bind(host, None, insecure=True)  # told so: allowed
    from svip_runtime.tls import TlsFiles

    check_bind(host, TlsFiles.from_dir(str(make_tls_dir(tmp_path))))  # with mutual TLS: allowed
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        check_bind(loopback, None)
    with pytest.raises(InvalidRequest, match="one address"):
        check_bind("0.0.0.0", None, insecure=True)


def test_a_peer_that_opens_ten_thousand_sessions_is_refused_past_the_cap(workers, engine, models, prompt_ids, loop):
    """Paused starts (load_cap 0) take no KV page but keep their prompt: without a cap a peer grew
    the draft's memory without bound. Past MAX_SESSIONS_PER_STREAM each start is refused alone."""
    draft = workers.draft
    requests = [
        GenerationRequest(prompt_ids[name], 30, policy=CONSTANT, ignore_eos=True) for name in ("short", "medium")
    ]

    async def scenario():
        async with grpc.aio.insecure_channel(workers.draft_address) as channel:
            outgoing: asyncio.Queue = asyncio.Queue()

            async def gen():
                while (r := await outgoing.get()) is not None:
                    yield r

            call = pb_grpc.DraftWorkerStub(channel).Session(gen())
            for i in range(PEER_SESSIONS):
                start = pb.StartSession(
                    session_id=f"peer-{i}",
                    prompt_ids=[5, 6, 7, 8],
                    max_new_tokens=8,
                    load_cap=0,
                    sampling=pb.SamplingParams(top_p=1.0),
                    pipeline=pb.PIPELINE_ASYNC,
                )
                start.policy.CopyFrom(
                    pb.PolicyConfig(
                        name="constant",
                        threshold=0.3,
                        entropy_scale=0.15,
                        draft_length=3,
                        max_draft_length=8,
                        confidence=0.4,
                    )
                )
                outgoing.put_nowait(pb.DraftRequest(start=start))
            refused = []
            while len(refused) < PEER_SESSIONS - MAX_SESSIONS_PER_STREAM:
                message = await asyncio.wait_for(call.read(), 120)
                for event, _ in unpack(message, pb.DraftEvent):  # a step's events come as one message
                    if event.WhichOneof("kind") == "error":
                        refused.append(event.error)
            held = len(draft.sessions)
            results = await asyncio.gather(*(engine.generate(r) for r in requests))  # another stream's sessions
            outgoing.put_nowait(None)
            return refused, held, results

    refused, held, results = loop.run_until_complete(scenario())
    assert all(
        e.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "limit per stream" in e.message for e in refused
    ), refused[:2]
    assert held == MAX_SESSIONS_PER_STREAM
    assert [r.token_ids for r in results] == [alone(models, r) for r in requests]
    assert all(r.stats.draft_tokens > 0 and r.stats.detached == 0 for r in results), [r.stats for r in results]

    async def freed():
        return not draft.sessions

    loop.run_until_complete(async_wait_until(freed, what="the peer's sessions freed with its stream"))


def test_the_distributed_batch_waits_for_kv_room(workers, engine, models, prompt_ids, loop):
    """run_admitted (svip generate --mode distributed --batch-size N): eight requests of 112 tokens
    each at batch size 8 on a 256-token pool run two at a time, in order, every one exact."""
    requests = [
        GenerationRequest(prompt_ids["medium"][:12] + (i,), 99, policy=CONSTANT, ignore_eos=True) for i in range(8)
    ]
    running, most = [0], [0]

    async def generate(request):
        running[0] += 1
        most[0] = max(most[0], running[0])
        try:
            return await engine.generate(request)
        finally:
            running[0] -= 1

    results = loop.run_until_complete(run_admitted(requests, 8, TARGET_POOL_TOKENS, generate))
    assert most[0] == 2
    assert [r.token_ids for r in results] == [alone(models, r) for r in requests]
