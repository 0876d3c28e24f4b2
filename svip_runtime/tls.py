"""Mutual TLS for the workers' gRPC when they cross nodes (off on loopback): a directory holding
``ca.crt``, ``tls.crt`` and ``tls.key`` (a Kubernetes TLS Secret plus its CA, mounted on every
node). Every worker serves with the certificate and dials with it, and accepts only peers whose
certificate the CA signed. Certificates name the workers by ``server_name`` (a subjectAltName),
not by address, so one certificate serves whatever node a worker lands on."""

from __future__ import annotations

import os
from dataclasses import dataclass

import grpc

from svip_common.errors import SvipError

FILES = ("ca.crt", "tls.crt", "tls.key")
SERVER_NAME = "svip-worker"


@dataclass(frozen=True)
class TlsFiles:
    directory: str
    server_name: str = SERVER_NAME

    @classmethod
    def from_dir(cls, directory: str, server_name: str = SERVER_NAME) -> TlsFiles:
        """Checked up front: a missing or unreadable file is an error that names it."""
        for name in FILES:
            path = os.path.join(directory, name)
            if not os.path.isfile(path) or not os.access(path, os.R_OK):
                raise SvipError(f"--grpc-tls-dir {directory!r}: no readable {name} (needs {', '.join(FILES)})")
        return cls(os.path.abspath(directory), server_name)

    def _read(self, name: str) -> bytes:
        with open(os.path.join(self.directory, name), "rb") as f:
            return f.read()

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self._read("tls.key"), self._read("tls.crt"))],
                                           root_certificates=self._read("ca.crt"), require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._read("ca.crt"), private_key=self._read("tls.key"),
                                            certificate_chain=self._read("tls.crt"))

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)]
