"""The target model as a Ray actor serving TargetWorker over gRPC. Its process also hosts the
coordinator's sessions (coordinator/session/host.py) beside the verifier, so a round is one hop each way
between it and the draft worker."""

from __future__ import annotations

from coordinator.session.host import SessionHost
from svip_common.auto_prior import estimate_from
from svip_common.pair_config import PairConfig
from svip_proto import svip_pb2_grpc as pb_grpc
from svip_runtime.actor import ModelActor
from target_worker.verifier import Verifier


class TargetActor(ModelActor):
    service_name = "svip.v1.TargetWorker"

    def __init__(self, config: PairConfig, limits, host: str | None = "127.0.0.1", tls=None,
                 auto_prior: dict | None = None, feature_layers: tuple[int, ...] = ()):
        """config: the pair's (svip_common/pair_config.py); host: where to listen; tls: mutual TLS
        with the draft; auto_prior: the pair's stored prior (None: the generic one);
        feature_layers: the hidden states a feature draft reads, sent with each feedback."""
        super().__init__(config.target, limits, dtype=config.dtype, device=config.device, host=host, tls=tls,
                         kv_cache_tokens=config.kv_cache_tokens, insecure=config.insecure_workers)
        self.config = config
        self.feature_layers = tuple(feature_layers)
        self.auto = estimate_from(auto_prior, config.auto.check())
        self.ranks: list = []  # a tensor-parallel target's ranks past 0 (its own actors: svip_runtime/ranks.py)

    def load(self) -> None:
        """The weights: the whole target, or rank 0's shard of a tensor-parallel one, whose other
        ranks start here (this actor's own: they end with it) and join its group."""
        if self.model is not None or self.config.target_tp == 1:
            return super().load()
        import ray

        from svip_common.models import load_model
        from svip_common.tensor_parallel import connect, free_port
        from svip_runtime.ranks import start_ranks

        config, gpus = self.config, self.config.device.startswith("cuda")
        host = self.host or ray.util.get_node_ip_address()
        port = free_port(host)
        self.ranks = start_ranks(config.target, config.dtype, config.device, config.target_tp, host, port, gpus,
                                 config.worker_cpus)
        group = connect(0, config.target_tp, host, port, "cuda" if gpus else "cpu")
        self.model = load_model(config.target, config.dtype, "cuda" if gpus else config.device, group=group)

    def rank_pids(self) -> list[int]:
        """The processes of its tensor-parallel ranks past 0 (what a fault drill signals)."""
        import ray

        return ray.get([rank.pid.remote() for rank in self.ranks], timeout=60)

    def make_service(self, draft_address: str | None = None, draft=None):
        """draft_address: the draft worker's; draft: its Ray actor (asked for the address, and
        for a replacement's after a loss)."""
        verifier = Verifier(self.model, self.limits.tokens, self.kv_cache_tokens, self.feature_layers)
        if (emulation := self.config.emulation()) is not None:
            verifier.pool.timing = emulation.target_timing()
        return SessionHost(verifier, self.limits, self.config, draft_address, self.tls, draft_actor=draft,
                           auto=self.auto)

    async def on_start(self, service: SessionHost) -> None:
        await service.start()

    def register(self, server, service) -> None:
        pb_grpc.add_TargetWorkerServicer_to_server(service, server)
