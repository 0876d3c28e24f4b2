"""The draft model as a Ray actor serving DraftWorker over gRPC."""

from __future__ import annotations

from draft_worker.drafter import Drafter
from draft_worker.service import DraftService
from svip_proto import svip_pb2_grpc as pb_grpc
from svip_runtime.actor import ModelActor


class DraftActor(ModelActor):
    service_name = "svip.v1.DraftWorker"

    def __init__(
        self, model_path: str, limits, target_vocab_size: int, max_batched_tokens: int | None = None, **kwargs
    ):
        """max_batched_tokens: at most this many tokens in one draft forward (a prompt is
        prefilled in chunks under it, as on the target)."""
        super().__init__(model_path, limits, **kwargs)
        self.target_vocab_size = target_vocab_size
        self.max_batched_tokens = max_batched_tokens

    def make_service(self):
        drafter = Drafter(
            self.model, self.target_vocab_size, self.limits.tokens, self.kv_cache_tokens, self.max_batched_tokens
        )
        return DraftService(drafter, self.limits)

    def register(self, server, service) -> None:
        pb_grpc.add_DraftWorkerServicer_to_server(service, server)
