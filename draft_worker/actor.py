"""The draft model as a Ray actor serving DraftWorker over gRPC: a small model of its own, or a
feature head (EAGLE-3 layout) beside the target's embedding table, reading the target's features
from each feedback."""

from __future__ import annotations

import torch

from draft_worker.drafter import Drafter
from draft_worker.feature_draft import FeatureDrafter, LoadedHead, load_head_beside
from draft_worker.service import DraftService
from svip_common.models import is_feature_head
from svip_common.pair_config import PairConfig
from svip_proto import svip_pb2_grpc as pb_grpc
from svip_runtime.actor import ModelActor


class DraftActor(ModelActor):
    service_name = "svip.v1.DraftWorker"

    def __init__(self, config: PairConfig, limits, target_vocab_size: int, host: str | None = "127.0.0.1", tls=None,
                 bundle: int | None = None):
        """config: the pair's (svip_common/pair_config.py: its draft, and the target's checkpoint,
        whose embedding table a feature head reads; max_batched_tokens caps a draft forward too,
        a prompt prefilled in chunks under it; draft_tp its ranks); host: where to listen; tls:
        mutual TLS with the target; bundle: its placement group's bundle, where a tensor-parallel
        draft's other ranks go."""
        super().__init__(config.draft, limits, dtype=config.dtype, device=config.device, host=host, tls=tls,
                         kv_cache_tokens=config.kv_cache_tokens, insecure=config.insecure_workers,
                         tp=config.draft_tp, bundle=bundle, rank_cpus=config.worker_cpus)
        self.target_vocab_size = target_vocab_size
        self.max_batched_tokens = config.max_batched_tokens
        self.target_path = config.target
        self.emulation = config.emulation()
        self.parallel = config.draft_parallel

    def load(self) -> None:
        model_path, dtype, device = self._load_args
        if not is_feature_head(model_path):
            return super().load()
        if self.model is None:
            if device == "auto":
                device = "cuda" if torch.cuda.is_available() else "cpu"
            self.model = load_head_beside(model_path, self.target_path, dtype, device)

    def make_service(self):
        if isinstance(self.model, LoadedHead):
            drafter = FeatureDrafter(self.model, self.model.embedding, self.target_vocab_size, self.limits.tokens,
                                     self.kv_cache_tokens)
        else:
            drafter = Drafter(
                self.model, self.target_vocab_size, self.limits.tokens, self.kv_cache_tokens, self.max_batched_tokens
            )
        if self.emulation is not None:
            drafter.time_as(self.emulation.draft_timing())
        return DraftService(drafter, self.limits, parallel=self.parallel)

    def register(self, server, service) -> None:
        pb_grpc.add_DraftWorkerServicer_to_server(service, server)
