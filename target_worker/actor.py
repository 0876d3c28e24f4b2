"""The target model as a Ray actor serving TargetWorker over gRPC."""

from __future__ import annotations

from svip_common.actor import ModelActor
from svip_proto import svip_pb2_grpc as pb_grpc
from target_worker.service import TargetService
from target_worker.verifier import Verifier


class TargetActor(ModelActor):
    service_name = "svip.v1.TargetWorker"

    def make_service(self):
        return TargetService(Verifier(self.model, self.limits.tokens), self.limits)

    def register(self, server, service) -> None:
        pb_grpc.add_TargetWorkerServicer_to_server(service, server)

    def vocabulary(self) -> dict:
        return self.model.tokenizer.get_vocab()
