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
                 auto_prior: dict | None = None, feature_layers: tuple[int, ...] = (), bundle: int | None = None):
        """config: the pair's (svip_common/pair_config.py); host: where to listen; tls: mutual TLS
        with the draft; auto_prior: the pair's stored prior (None: the generic one);
        feature_layers: the hidden states a feature draft reads, sent with each feedback; bundle:
        its placement group's bundle, where a tensor-parallel target's other ranks go."""
        super().__init__(config.target, limits, dtype=config.dtype, device=config.device, host=host, tls=tls,
                         kv_cache_tokens=config.kv_cache_tokens, insecure=config.insecure_workers,
                         tp=config.target_tp, bundle=bundle, rank_cpus=config.worker_cpus)
        self.config = config
        self.feature_layers = tuple(feature_layers)
        self.auto = estimate_from(auto_prior, config.auto.check())

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
