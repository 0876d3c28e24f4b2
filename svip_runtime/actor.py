"""The lifecycle both worker actors share: load a model, serve it over gRPC, report health,
shut down. Each worker package subclasses it with the service it hosts (draft_worker/actor.py,
coordinator/session/actor.py); Ray places the actor (its GPU, or a CPU core and a role resource).

A worker listens on one address, never the wildcard: 127.0.0.1 in the local mode and whenever the
pair is packed on one node, its node's own address when spread (``host=None``), with mutual TLS
there (plaintext off loopback is refused unless ``insecure``)."""

from __future__ import annotations

import asyncio
import logging
import sys

import torch

from svip_common.contracts import Limits
from svip_common.errors import WorkerUnavailable
from svip_common.heap import freeze_heap, thaw_heap
from svip_common.kv_sizes import DEFAULT_KV_TOKENS
from svip_common.models import LoadedModel, load_model
from svip_runtime.grpc_server import check_bind, start_server
from svip_runtime.tls import TlsFiles

log = logging.getLogger(__name__)


SWITCH_INTERVAL_S = 0.0005


class ModelActor:
    service_name = ""

    def __init__(self, model_path: str, limits: Limits, dtype: str = "float32", device: str = "cpu",
                 threads: int = 1, host: str | None = "127.0.0.1", tls: TlsFiles | None = None,
                 kv_cache_tokens: int = DEFAULT_KV_TOKENS, insecure: bool = False, tp: int = 1,
                 bundle: int | None = None, rank_cpus: float = 1.0):
        """Cheap: the actor answers as soon as Ray has placed it; load() brings the weights.
        kv_cache_tokens: the worker's KV pool, in tokens, shared by its sessions; insecure: serve
        plaintext on a non-loopback address (refused otherwise); tp: the model's tensor-parallel
        ranks (this actor is rank 0; the others its own actors, in its placement group's bundle,
        rank_cpus each: svip_runtime/ranks.py)."""
        self.insecure = insecure
        self.kv_cache_tokens = kv_cache_tokens
        torch.set_num_threads(threads)
        # the event loop thread waits for the GIL while the compute thread runs Python between
        # torch ops; hand it over every 0.5 ms instead of every 5 ms, so I/O is not held back
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._load_args = (model_path, dtype, device)
        self.tp, self.bundle, self.rank_cpus = tp, bundle, rank_cpus
        self.ranks: list = []  # a tensor-parallel model's ranks past 0 (this actor's own)
        self.model: LoadedModel | None = None
        self.limits = limits  # what this worker accepts from the wire (the pair's, not only its own)
        self.host, self.tls = host, tls
        self.service = None
        self._serve_lock = asyncio.Lock()  # serve() asked twice at once starts one server
        self._server = None
        self.port = None

    def placed(self) -> bool:
        """Answers once Ray has placed the actor (its GPU or CPU reserved, its process up)."""
        return True

    def placement(self) -> dict:
        """Where this worker runs: its node, the GPUs Ray gave it, the devices its weights are on."""
        import ray

        devices = sorted({str(p.device) for p in self.model.model.parameters()}) if self.model is not None else []
        return {"node": ray.util.get_node_ip_address(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "devices": devices}

    def load(self) -> None:
        """Load the weights (from the hub's cache, or downloading them first): the whole model, or
        rank 0's shard of a tensor-parallel one, whose other ranks start here and join its group."""
        if self.model is None:
            model_path, dtype, device = self._load_args
            if device == "auto":
                device = "cuda" if torch.cuda.is_available() else "cpu"
            if self.tp > 1:
                from svip_runtime.ranks import load_rank_zero

                self.model, self.ranks = load_rank_zero(model_path, dtype, device, self.tp, self.host, self.bundle,
                                                        self.rank_cpus)
                return
            # Ray makes only this actor's GPUs visible: more than one means the model spans them
            spread = device.startswith("cuda") and torch.cuda.device_count() > 1
            self.model = load_model(model_path, dtype, device, spread=spread)

    def rank_pids(self) -> list[int]:
        """The processes of its tensor-parallel ranks past 0 (what a fault drill signals)."""
        import ray

        return ray.get([rank.pid.remote() for rank in self.ranks], timeout=60)

    def make_service(self, **kwargs):
        raise NotImplementedError

    def register(self, server, service) -> None:
        raise NotImplementedError

    async def start(self, **kwargs) -> str:
        """Start the gRPC server; returns its address host:port."""
        if self._server is None:
            # off the actor's event loop: Ray answers pid() (the hang probe) there while weights load
            await asyncio.to_thread(self.load)
            if self.host is None:
                import ray

                self.host = ray.util.get_node_ip_address()
            check_bind(self.host, self.tls, self.insecure)  # before any compute thread starts
            service = self.make_service(**kwargs)
            freeze_heap()  # what loading left is never traversed again by a full collection mid-step
            try:
                await self.on_start(service)
            except BaseException:
                await service.close()  # its compute thread too; a later start begins afresh
                raise
            self.service = service
            self._server, self.port = await start_server(lambda s: self.register(s, self.service), self.service_name,
                                                         self.host, self.tls, self.insecure)
        return f"{self.host}:{self.port}"

    async def serve(self, **kwargs) -> str:
        """Load and serve if not yet (a restarted actor comes back bare); returns the address.
        What a coordinator asks after a worker's loss: Ray holds the call until the restart."""
        async with self._serve_lock:
            return await self.start(**kwargs)

    def pid(self) -> int:
        """The worker's process (what an operator, or a fault drill, signals)."""
        import os

        return os.getpid()

    async def on_start(self, service) -> None:
        """Before the server opens (the target connects to its draft here)."""

    async def health(self) -> bool:
        return self._server is not None

    async def shutdown(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=1.0)
            self._server = None
            await self.service.close()
            thaw_heap()  # what start froze: the closed service is freed; a later start freezes afresh


DIED_ASKS = 3  # an actor is dead for good when this many asks in a row (a second apart) find it dead
HANG_PROBE_S = 30.0  # a worker whose process does not answer within this is hung: it is killed and replaced


class WorkerGone(WorkerUnavailable):
    """A worker's actor is dead for good: its restarts are spent, or it was shut down."""


async def serving_address(actor, role: str, timeout_s: float, start: dict | None = None,
                          kill_when_hung: bool = False) -> str:
    """A worker actor's address once it serves: its serve() loads and serves if the actor came
    back bare from a restart (Ray holds or refuses calls while it restarts: asked again).
    kill_when_hung: an actor whose process does not answer within HANG_PROBE_S is killed, so that
    Ray replaces it. WorkerGone: dead for good; WorkerUnavailable: not serving within timeout_s."""
    import time

    import ray

    deadline, killed, died = time.monotonic() + timeout_s, False, 0
    while (left := deadline - time.monotonic()) > 0:
        try:
            if kill_when_hung and not killed:
                # pid() answers at once from a live process, and from a restarted one as soon as it
                # runs (before any weights load); only a hung one (stopped, stuck) lets it time out
                try:
                    await asyncio.wait_for(actor.pid.remote(), min(left, HANG_PROBE_S))
                except asyncio.TimeoutError:
                    ray.kill(actor, no_restart=False)  # Ray replaces it
                    killed = True
                    continue
            return await asyncio.wait_for(actor.serve.remote(**(start or {})), left)
        except asyncio.TimeoutError:
            break
        except ray.exceptions.ActorDiedError as exc:
            # a call that met the death itself fails so too, restarts left or not; only a dead
            # actor keeps failing so, ask after ask
            died += 1
            if died >= DIED_ASKS:
                raise WorkerGone(f"the {role} worker is gone for good (its restarts are spent): "
                                 f"{str(exc).strip().splitlines()[0]}") from None
            await asyncio.sleep(1.0)
        except ray.exceptions.RayActorError:  # restarting: ask again
            died = 0
            await asyncio.sleep(0.25)
        except ray.exceptions.RayTaskError as exc:  # its start failed (a peer not up yet): ask again
            log.warning("the %s worker did not start: %s", role, str(exc).strip().splitlines()[-1])
            await asyncio.sleep(1.0)
    raise WorkerUnavailable(f"the {role} worker did not come back within {timeout_s:.0f} s")
