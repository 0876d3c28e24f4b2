"""The target model as a Ray actor serving TargetWorker over gRPC. Its process also hosts the
coordinator's sessions (coordinator/session/host.py) beside the verifier, so a round is one hop each way
between it and the draft worker."""

from __future__ import annotations

from coordinator.session.host import SessionHost
from svip_common.auto_prior import estimate_from
from svip_common.auto_settings import AutoSettings
from svip_proto import svip_pb2_grpc as pb_grpc
from svip_runtime.actor import ModelActor
from target_worker.verifier import Verifier


class TargetActor(ModelActor):
    service_name = "svip.v1.TargetWorker"

    def __init__(self, model_path: str, limits, max_batched_tokens: int | None = None, load_aware: str = "greedy",
                 recovery: dict | None = None, auto: AutoSettings = AutoSettings(), auto_prior: dict | None = None,
                 feature_layers: tuple[int, ...] = (), idle_prefill: str = "auto", **kwargs):
        """recovery: SessionHost's draft_stall_s / sampled_hold_s / draft_recover_s; auto: the
        `auto` policy's settings; auto_prior: the pair's stored prior (None: the generic one);
        feature_layers: the hidden states a feature draft reads, sent with each feedback;
        idle_prefill: SessionHost's (what the target does while no block is ready)."""
        super().__init__(model_path, limits, **kwargs)
        self.feature_layers = tuple(feature_layers)
        self.max_batched_tokens, self.load_aware = max_batched_tokens, load_aware
        self.recovery = recovery or {}
        self.idle_prefill = idle_prefill
        self.auto = estimate_from(auto_prior, auto.check())

    def make_service(self, draft_address: str | None = None, draft=None):
        """draft_address: the draft worker's; draft: its Ray actor (asked for the address, and
        for a replacement's after a loss)."""
        verifier = Verifier(self.model, self.limits.tokens, self.kv_cache_tokens, self.feature_layers)
        return SessionHost(verifier, self.limits, draft_address, self.tls, self.max_batched_tokens, self.load_aware,
                           draft_actor=draft, auto=self.auto, idle_prefill=self.idle_prefill, **self.recovery)

    async def on_start(self, service: SessionHost) -> None:
        await service.start()

    def register(self, server, service) -> None:
        pb_grpc.add_TargetWorkerServicer_to_server(service, server)
