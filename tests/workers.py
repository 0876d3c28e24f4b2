"""A real draft service and a real session host serving gRPC on loopback, hosted in the test's own
process without Ray: for the tests that drive the caller's end against them, or inject a fault at
a precise point on the host's compute thread."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

from coordinator.distributed import DistributedEngine
from coordinator.session.host import SessionHost
from draft_worker.drafter import Drafter
from draft_worker.service import DraftService
from svip_common.contracts import Limits
from svip_common.kv_sizes import DEFAULT_KV_TOKENS
from svip_common.models import load_model_info
from svip_common.pair_config import PairConfig
from svip_proto import svip_pb2_grpc as pb_grpc
from svip_runtime.grpc_server import start_server
from target_worker.verifier import Verifier
from tests.gates import async_wait_until


@dataclasses.dataclass
class InProcessWorkers:
    host: SessionHost
    draft: DraftService
    limits: Limits
    target_address: str
    draft_address: str


@contextlib.contextmanager
def in_process_workers(
    loop,
    models,
    draft_kv_tokens: int = DEFAULT_KV_TOKENS,
    target_kv_tokens: int = DEFAULT_KV_TOKENS,
    positions: int = 512,
    drafter=None,
    feature_layers: tuple[int, ...] = (),
    **host_options,
):
    """The tiny target behind a session host, the close draft (or ``drafter``: a feature draft,
    whose target hands over ``feature_layers``) behind a draft service (KV pools of
    target_kv_tokens and draft_kv_tokens); host_options: the pair's configuration as flat options
    (PairConfig.of). On exit the host closes first, so its link goes and the draft frees that
    stream's sessions, then both servers stop."""
    limits = Limits(tokens=models["target"].token_limit, positions=positions)
    drafter = drafter or Drafter(
        models["close_draft"],
        models["target"].vocab_size,
        limits.tokens,
        kv_cache_tokens=draft_kv_tokens,
        max_batched_tokens=host_options.get("max_batched_tokens"),
    )
    draft = DraftService(drafter, limits)
    servers = []

    def serve(servicer, add, name: str) -> str:
        server, port = loop.run_until_complete(start_server(lambda s: add(servicer, s), name))
        servers.append(server)
        return f"127.0.0.1:{port}"

    draft_address = serve(draft, pb_grpc.add_DraftWorkerServicer_to_server, "svip.v1.DraftWorker")
    draft_path = getattr(getattr(drafter, "draft", None), "path", None) or "a feature draft"
    config = PairConfig.of(models["target"].path, draft_path, **host_options)
    host = SessionHost(Verifier(models["target"], limits.tokens, target_kv_tokens, feature_layers), limits, config,
                       draft_address)
    loop.run_until_complete(host.start())
    target_address = serve(host, pb_grpc.add_TargetWorkerServicer_to_server, "svip.v1.TargetWorker")
    try:
        yield InProcessWorkers(host, draft, limits, target_address, draft_address)
    finally:
        loop.run_until_complete(host.close())
        deadline = time.monotonic() + 300  # bounds a failure only
        while draft.sessions and time.monotonic() < deadline:
            loop.run_until_complete(asyncio.sleep(0.05))
        for server in servers:
            loop.run_until_complete(server.stop(None))


def generate_through(loop, workers: InProcessWorkers, target_path: str, pipeline: str, requests,
                     return_exceptions: bool = False) -> list:
    """The requests at once through the caller's end (coordinator/distributed.py) to these workers;
    return_exceptions: a request's error in its place instead of raised."""
    engine = DistributedEngine(load_model_info(target_path), workers.limits, workers.target_address,
                               workers.draft_address, pipeline)

    async def run_all():
        await engine.connect()
        try:
            return await asyncio.gather(*(engine.generate(r) for r in requests),
                                        return_exceptions=return_exceptions)
        finally:
            await engine.close()

    return loop.run_until_complete(run_all())


def generate_all_started(loop, workers: InProcessWorkers, target_path: str, pipeline: str, requests,
                         target_gate) -> list:
    """generate_through, with every session started on the target before any step runs (the
    target's steps held until then): they run side by side whatever the machine's speed."""
    engine = DistributedEngine(load_model_info(target_path), workers.limits, workers.target_address,
                               workers.draft_address, pipeline)

    async def run_all():
        await engine.connect()
        try:
            with target_gate.held():
                tasks = [asyncio.ensure_future(engine.generate(r)) for r in requests]
                await async_wait_until(lambda: asyncio.sleep(0, len(workers.host.sessions) == len(requests)),
                                       what="every session started")
            return await asyncio.gather(*tasks)
        finally:
            await engine.close()

    return loop.run_until_complete(run_all())


def assert_all_freed(host, draft, loop, timeout: float = 60.0) -> None:
    """Both workers end with no session and every page free (each frees its own on its compute
    thread after the caller's finish, the draft's through the event loop the host's link runs on):
    waited for as a condition, the deadline only a guard against a leak."""
    async def freed() -> bool:
        return not (host.sessions or host.pool.used_pages or draft.sessions or draft.pool.used_pages)

    loop.run_until_complete(async_wait_until(freed, timeout, "both workers freeing every session and page"))
    assert not host.sessions and not draft.sessions
    assert host.pool.used_pages == 0 and draft.pool.used_pages == 0
