"""The target model as a Ray actor serving TargetWorker over gRPC. Its process also hosts the
coordinator's sessions (coordinator/host.py) beside the verifier, so a round is one hop each way
between it and the draft worker."""

from __future__ import annotations

from coordinator.host import SessionHost
from svip_common.actor import ModelActor
from svip_proto import svip_pb2_grpc as pb_grpc
from target_worker.verifier import Verifier


class TargetActor(ModelActor):
    service_name = "svip.v1.TargetWorker"

    def make_service(self, draft_address: str | None = None):
        return SessionHost(Verifier(self.model, self.limits.tokens), self.limits, draft_address, self.tls)

    async def on_start(self, service: SessionHost) -> None:
        await service.start()

    def register(self, server, service) -> None:
        pb_grpc.add_TargetWorkerServicer_to_server(service, server)
