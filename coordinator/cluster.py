"""Ray placement of the two workers: a local Ray on this machine bound to loopback, a target
actor and a draft actor, each on its own GPU (num_gpus=1) or, without GPUs, on its own CPU core
(a role resource each and one torch thread), so that the two overlap for real."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager

from svip_common.auto_prior import stored_prior
from svip_common.errors import InvalidRequest, SvipError
from svip_common.kv_sizes import whole_pages
from svip_common.models import ModelInfo, check_same_vocabulary, is_feature_head, load_model_info, pair_limits
from svip_common.pair_config import PairConfig
from svip_runtime.actor import serving_address
from svip_runtime.tls import TlsFiles

log = logging.getLogger(__name__)
DRAFT_RESOURCE, TARGET_RESOURCE = "svip_draft", "svip_target"
RECOVER_TIMEOUT_S = 120.0  # a replaced worker serves again within this (restart, load, serve)


# Ray's dashboard agent always listens on this port (ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT;
# ray.init cannot move it): a metrics port there makes Ray refuse to start.
RAY_AGENT_PORT = 52365
# ray.init's messages when a process it started missed its wait, on which init_local_ray starts again:
# the raylet missed Ray's fixed 30 s to register; the GCS never published its port (its forked child
# once hung before exec: Ray runs Python in the child, and this process had gRPC threads).
RAY_SLOW_STARTS = ("timed out during startup", "Timed out waiting for file")
RAY_START_ATTEMPTS = 2


def init_local_ray(pairs: int = 1, metrics_port: int | None = None, target_ranks: int = 1,
                   draft_ranks: int = 1) -> None:
    """Start (or join) a Ray instance on this machine whose every listener is on 127.0.0.1.
    metrics_port: where Ray's agent serves Prometheus metrics (None: a free port); target_ranks,
    draft_ranks: each pair's models' tensor-parallel ranks (a logical CPU each)."""
    if metrics_port == RAY_AGENT_PORT:
        raise InvalidRequest(f"--metrics-port {RAY_AGENT_PORT} is where Ray's dashboard agent listens; choose another")
    # Read by ray when it is first imported, and inherited by the processes Ray starts
    # (docs/architecture.md, Placement). Never set in a cluster deployment.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if "ray" in sys.modules:  # imported before this call: ray read its switch already
        _ray_stays_on_loopback()
    # How long ray.init waits for the head's GCS to publish its port (Ray's default 30 s): a
    # bound on a failure only, which a busy machine (two test workers on two cores) once reached.
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
    import ray

    if ray.is_initialized():
        return
    options = dict(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        # a logical CPU per worker actor (each target rank), and per Serve replica
        num_cpus=max((1 + target_ranks + draft_ranks) * pairs, os.cpu_count() or 2),
        resources={DRAFT_RESOURCE: pairs, TARGET_RESOURCE: pairs},
        log_to_driver=False,
        configure_logging=False,
        _metrics_export_port=metrics_port,
    )
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        started_before = _child_pids()
        try:
            ray.init(**options)
            return
        except Exception as error:
            if not any(message in str(error) for message in RAY_SLOW_STARTS):
                raise
            # The processes that attempt started are this process's children and nobody else's
            # (a stuck one would hold its port and files): stop them, then start afresh or give up.
            stopped = _stop_children(_child_pids() - started_before)
            if attempt == RAY_START_ATTEMPTS:
                raise
            log.warning("Ray did not start (%s): stopped the %d processes it left, starting again", error, stopped)


def _child_pids() -> set[int]:
    import psutil  # Ray's own (ray/thirdparty_files), on the path once ray is imported

    return {child.pid for child in psutil.Process().children(recursive=True)}


def _stop_children(pids: set[int]) -> int:
    """Kill these processes (children of this one) and wait for them; how many were still alive."""
    import psutil

    alive = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            process.kill()
            alive.append(process)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=30)  # a bound on a failure only: SIGKILL ends them at once
    return len(alive)


def _ray_stays_on_loopback() -> None:
    """Ray 2.x resolves ray.init's _node_ip_address="127.0.0.1" to the machine's routable address
    unless its cluster switch is off (ray._private.services.resolve_ip_for_localhost), and it reads
    that switch from the environment once, at import. A process that imported ray before
    init_local_ray (`svip bench --mode pipeline` did) would put the whole local cluster on the
    machine's network: the switch is turned off where ray reads it."""
    from ray._private import ray_constants

    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        ray_constants.ENABLE_RAY_CLUSTER = False


def keep_serve_grpc_on_loopback() -> None:
    """Call in a Serve replica's constructor. Ray Serve 2.60 binds each replica's inter-deployment
    gRPC server to [::] whatever Ray was told (serve/_private/replica.py, after the constructor);
    on a Ray bound to loopback (local mode) it goes on 127.0.0.1 like every other listener. On a
    cluster this does nothing."""
    import ray
    from ray.serve._private import replica

    if ray.util.get_node_ip_address() != "127.0.0.1" or getattr(replica, "_svip_loopback", False):
        return
    bind = replica.add_port_to_grpc_server
    replica.add_port_to_grpc_server = lambda server, address: bind(server, address.replace("[::]", "127.0.0.1", 1))
    replica._svip_loopback = True


def actor_options(role: str, gpus: float, placement=None, bundle: int | None = None, cpus: float = 1) -> dict:
    """Ray options for a worker actor: its GPUs, or a CPU core and its role resource; inside a
    placement group (a Serve replica's, or the pair's own), its own bundle of that group instead
    of role resources."""
    if placement is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=placement, placement_group_bundle_index=bundle)
        return {"num_cpus": cpus, "num_gpus": gpus, "scheduling_strategy": strategy}
    if gpus > 0:
        return {"num_gpus": gpus}
    return {"num_cpus": 1, "resources": {DRAFT_RESOURCE if role == "draft" else TARGET_RESOURCE: 1}}


PLACEMENTS = {"pack": "STRICT_PACK", "spread": "STRICT_SPREAD"}  # draft and target on one node, or on two


def pair_placement_group(strategy: str, target_gpus: float, draft_gpus: float, cpus: float = 1,
                         target_cpus: float | None = None, draft_cpus: float | None = None):
    """A placement group of two bundles, the target's and the draft's, on one node or two. Where
    the cluster's nodes offer the role resources, each bundle asks for its role's (the nodes an
    operator marked for targets and for drafts). target_cpus, draft_cpus: a bundle's (every rank's
    of a tensor-parallel model; default cpus)."""
    import ray
    from ray.util.placement_group import placement_group

    offered = ray.cluster_resources()
    bundles = []
    target_cpus = cpus if target_cpus is None else target_cpus
    draft_cpus = cpus if draft_cpus is None else draft_cpus
    for gpus, role, bundle_cpus in ((target_gpus, TARGET_RESOURCE, target_cpus),
                                    (draft_gpus, DRAFT_RESOURCE, draft_cpus)):
        bundle = {"CPU": bundle_cpus, **({"GPU": gpus} if gpus else {})}
        if offered.get(TARGET_RESOURCE) and offered.get(DRAFT_RESOURCE):
            bundle[role] = 1
        bundles.append(bundle)
    return placement_group(bundles, strategy=PLACEMENTS[strategy])


class WorkerPair:
    """A target actor and (optionally) a draft actor, started and serving gRPC, as ``config``
    says (svip_common/pair_config.py); the target worker hosts the sessions and dials the draft
    itself. placement: a placement group whose bundles[0] / bundles[1] hold the target / the
    draft (a Serve replica's; config.packed says it keeps them on one node); without one, the
    layout config.layout makes a group of the pair's own. On a Ray bound to loopback the workers
    listen on 127.0.0.1, on a cluster on their node's address, with mutual TLS between them when
    config.grpc_tls_dir is given. A worker that dies is restarted (config.recovery) and a
    session outlives it (coordinator/session/draft_port.py, coordinator/distributed.py)."""

    def __init__(self, config: PairConfig, placement=None, bundles: tuple[int, int] = (0, 0)):
        import ray

        from coordinator.session.actor import TargetActor
        from draft_worker.actor import DraftActor
        from draft_worker.feature_draft import head_layers

        self.config = config = config.checked()
        self.target_info: ModelInfo = load_model_info(config.target)
        draft_info, feature_layers = None, ()
        if config.draft is not None and is_feature_head(config.draft):  # the target hands its features over
            if config.draft_tp > 1:
                raise InvalidRequest(f"draft_tp {config.draft_tp}: a feature head runs on one device")
            feature_layers = head_layers(config.draft, self.target_info.num_layers)
        elif config.draft is not None:
            draft_info = load_model_info(config.draft)
            check_same_vocabulary(self.target_info, draft_info)
        # a pool holds whole pages: its capacity, rounded up to them
        kv_tokens = whole_pages(config.kv_cache_tokens)
        self.limits = pair_limits(self.target_info, draft_info, config.draft_length_cap, kv_tokens)
        self.tls = TlsFiles.from_dir(config.grpc_tls_dir) if config.grpc_tls_dir else None
        self.start_timeout_s = config.worker_start_timeout_s
        self.target = self.draft = self._own_placement = None
        # a tensor-parallel target: rank 0 (this actor) takes one GPU, its other ranks one each from
        # the same bundle (svip_runtime/ranks.py), which asks for all of them
        tp, target_gpus = config.target_tp, config.gpus_of("target")
        if config.layout is not None and placement is None:
            placement = self._own_placement = pair_placement_group(
                config.layout, target_gpus * tp, config.gpus_of("draft") * config.draft_tp, config.worker_cpus,
                config.worker_cpus * tp, config.worker_cpus * config.draft_tp)
            bundles = (0, 1)
            if not placement.wait(config.placement_timeout_s):
                self.shutdown()
                spread = config.layout == "spread"
                raise SvipError(
                    f"no room to place the pair ({config.layout}): Ray has no {'two nodes' if spread else 'node'} "
                    f"with a free {'GPU' if config.on_gpus else 'CPU'} for each worker"
                )
        packed = config.packed or config.layout == "pack" or ray.util.get_node_ip_address() == "127.0.0.1"
        host = "127.0.0.1" if packed else None  # None: the node's address (two nodes)
        if host is None and self.tls is None and not config.insecure_workers:
            self.shutdown()
            raise InvalidRequest(
                "the workers would talk gRPC in plaintext between two nodes: give them mutual TLS "
                "(--grpc-tls-dir), or pass --insecure-workers on a network you trust"
            )
        self.kv_cache_tokens = config.kv_cache_tokens
        restarts = {"max_restarts": config.worker_restarts}
        self.target = (
            ray.remote(TargetActor)
            .options(**actor_options("target", target_gpus, placement, bundles[0], config.worker_cpus),
                     **restarts)
            .remote(config, self.limits, host=host, tls=self.tls, auto_prior=stored_prior(config.draft),
                    feature_layers=feature_layers, bundle=bundles[0] if placement is not None else None)
        )
        self.target_address = self.draft_address = None
        if config.draft is not None:
            self.draft = (
                ray.remote(DraftActor)
                .options(**actor_options("draft", config.gpus_of("draft"), placement, bundles[1], config.worker_cpus),
                         **restarts)
                .remote(config, self.limits, target_vocab_size=self.target_info.vocab_size, host=host, tls=self.tls,
                        bundle=bundles[1] if placement is not None else None)
            )
        actors = [a for a in (self.target, self.draft) if a is not None]
        with self._starting(
            f"the workers were not placed within {config.placement_timeout_s:.0f} s: Ray has no free "
            f"GPU / '{DRAFT_RESOURCE}' / '{TARGET_RESOURCE}' slot for them"
        ):
            ray.get([a.placed.remote() for a in actors], timeout=config.placement_timeout_s)
        with self._starting(
            f"the workers were placed but did not load their weights within {config.worker_start_timeout_s:.0f} s "
            f"(a first download from the hub counts): raise the start timeout (worker_start_timeout_s, "
            f"the chart's serve.workerStartTimeoutS) or mount a weights cache"
        ):  # both load their weights at once; the draft serves first, then the target dials it
            ray.get([a.load.remote() for a in actors], timeout=config.worker_start_timeout_s)
            wait_s = config.placement_timeout_s
            self.draft_address = ray.get(self.draft.start.remote(), timeout=wait_s) if self.draft is not None else None
            self.target_address = ray.get(self.target.start.remote(**self._target_start()), timeout=wait_s)

    @contextmanager
    def _starting(self, late: str):
        """One step of starting the workers: past its timeout (``late`` says what to do) or with a
        worker dead, both workers are shut down and the caller gets a SvipError that says which."""
        import ray

        try:
            yield
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise SvipError(late) from None
        except ray.exceptions.RayActorError as exc:
            self.shutdown()
            raise SvipError(f"a worker failed to start: {exc}") from None

    def _target_start(self, fresh: bool = True) -> dict:
        """What the target's start() needs: its draft's actor, and its address when it is known
        to be current (a restarted target asks the draft actor: the draft may have been replaced)."""
        if self.draft is None:
            return {}
        return {"draft_address": self.draft_address if fresh else None, "draft": self.draft}

    async def recover_target(self, timeout_s: float | None = None) -> str:
        """The target worker's address once it serves again: Ray restarts a dead one (its serve()
        loads the weights and dials the draft); a hung one is killed first, so that Ray replaces
        it. WorkerUnavailable when it cannot be had (restarts spent, or not back within timeout_s:
        by default as long as a first start may take, loading included)."""
        timeout_s = timeout_s if timeout_s is not None else max(RECOVER_TIMEOUT_S, self.start_timeout_s)
        self.target_address = await serving_address(
            self.target, "target", timeout_s, self._target_start(fresh=False), kill_when_hung=True
        )
        return self.target_address

    async def draft_serving_address(self, timeout_s: float = RECOVER_TIMEOUT_S) -> str:
        """The draft worker's address now (a replaced draft serves on a new port)."""
        self.draft_address = await serving_address(self.draft, "draft", timeout_s)
        return self.draft_address

    def kill(self, role: str, restart: bool = False) -> None:
        """Kill a worker's actor (restart: as a crash would, so Ray replaces it)."""
        import ray

        ray.kill(self.target if role == "target" else self.draft, no_restart=not restart)

    def pids(self) -> dict[str, int]:
        """Each worker's process id."""
        import ray

        actors = {"target": self.target, "draft": self.draft}
        return {role: ray.get(actor.pid.remote(), timeout=30) for role, actor in actors.items() if actor is not None}

    def shutdown(self) -> None:
        import ray

        for actor in (self.target, self.draft):
            if actor is not None:
                try:
                    ray.get(actor.shutdown.remote(), timeout=10)
                except Exception:  # already dead: nothing to stop
                    pass
                ray.kill(actor, no_restart=True)
        if self._own_placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._own_placement)
            self._own_placement = None
