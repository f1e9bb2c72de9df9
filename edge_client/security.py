"""TLS, mutual TLS and the auth token on the edge (`edge-client --tls --tls-ca --tls-cert
--tls-key --auth-token-file`, or the token in SPLITDEC_AUTH_TOKEN)."""
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
    certificate_chain: bytes | None = None  # PEM; mutual TLS: this client's certificate
    private_key: bytes | None = None

    def channel(self, address: str, options: list[tuple[str, int]]) -> grpc.aio.Channel:
        if not self.tls and self.root_certificates is None and self.certificate_chain is None:
            return grpc.aio.insecure_channel(address, options=options)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates, private_key=self.private_key,
            certificate_chain=self.certificate_chain)
        return grpc.aio.secure_channel(address, credentials, options=options)

    def metadata(self) -> Metadata:
        return () if self.auth_token is None else ((AUTH_HEADER, bearer(self.auth_token)),)
