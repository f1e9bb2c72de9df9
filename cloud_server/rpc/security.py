"""TLS, mutual TLS and the auth token on the server (`cloud-server --tls-cert --tls-key
--tls-client-ca --auth-token-file`).

With a token, every call but the health service's must carry it (shared/auth.py): container
and Kubernetes probes carry none. A call without it ends UNAUTHENTICATED, before any model work.
With a client CA, only clients holding a certificate it signed can connect, and a session can
be resumed only over a connection proving the certificate that opened it (`caller`).
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import grpc

from shared.auth import AUTH_HEADER, bearer, read_token

OPEN_METHODS = "/grpc.health.v1.Health/"


@dataclass(frozen=True)
class Security:
    cert_chain: bytes | None = None  # PEM; with private_key, the server speaks TLS only
    private_key: bytes | None = None
    auth_token: str | None = None
    client_ca: bytes | None = None  # PEM; clients must present a certificate it signed

    @classmethod
    def from_files(cls, cert: str | None, key: str | None, token: str | None,
                   client_ca: str | None = None) -> "Security":
        if (cert is None) != (key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if client_ca is not None and cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return cls(_read(cert), _read(key), None if token is None else read_token(token),
                   _read(client_ca))

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.cert_chain is None or self.private_key is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [] if self.auth_token is None else [TokenCheck(self.auth_token)]


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


class TokenCheck(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = bearer(token).encode()

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS) or self._carried(details):
            return handler
        return _refusal(handler)

    def _carried(self, details: grpc.HandlerCallDetails) -> bool:
        given = dict(details.invocation_metadata or ()).get(AUTH_HEADER, "")
        given_bytes = given.encode() if isinstance(given, str) else given
        return hmac.compare_digest(given_bytes, self._expected)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call UNAUTHENTICATED."""
    async def deny(request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong auth token (edge-client --auth-token-file)")

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def caller(context: grpc.aio.ServicerContext) -> str | None:
    """Who is calling, as far as the connection proves it: the sha256 of the client's
    certificate under mutual TLS; None otherwise (a bearer token is shared by every edge, so
    it names no one, and then the session id, 122 random bits, is what only its opener knows)."""
    certificate = context.auth_context().get("x509_pem_cert")
    return hashlib.sha256(certificate[0]).hexdigest() if certificate else None
