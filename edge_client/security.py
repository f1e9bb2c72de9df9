"""TLS and the auth token on the edge (`edge-client --tls --tls-ca --auth-token-file`)."""
from __future__ import annotations

from dataclasses import dataclass

import grpc

from shared.auth import AUTH_HEADER, bearer

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ClientSecurity:
    tls: bool = False
    root_certificates: bytes | None = None  # PEM; None: the system's roots (with tls)
    auth_token: str | None = None

    def channel(self, address: str, options: list[tuple[str, int]]) -> grpc.aio.Channel:
        if not self.tls and self.root_certificates is None:
            return grpc.aio.insecure_channel(address, options=options)
        credentials = grpc.ssl_channel_credentials(root_certificates=self.root_certificates)
        return grpc.aio.secure_channel(address, credentials, options=options)

    def metadata(self) -> Metadata:
        return () if self.auth_token is None else ((AUTH_HEADER, bearer(self.auth_token)),)
