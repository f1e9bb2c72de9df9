"""The auth token's place on the wire, for both sides: gRPC metadata `authorization: Bearer T`."""
from __future__ import annotations

AUTH_HEADER = "authorization"
TOKEN_VARIABLE = "SPLITDEC_AUTH_TOKEN"  # the edge's token when no --auth-token-file is given


def bearer(token: str) -> str:
    return f"Bearer {token}"


def read_token(path: str) -> str:
    """A token from a file (a mounted Kubernetes Secret, say), surrounding whitespace removed."""
    with open(path) as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"{path} holds no auth token")
    return token
