"""Domain errors that the server's boundary turns into gRPC status codes.

Model and session code raise these; only `cloud_server/rpc/grpc_status.py` maps them to gRPC.
"""
from __future__ import annotations


class SplitDecodingError(Exception):
    """Base class: a request the server refuses, with a message meant for the caller."""


class InvalidRequest(SplitDecodingError):
    """Malformed input: bad token ids, a bad tree, a prompt over the limit (INVALID_ARGUMENT)."""


class OutOfOrder(SplitDecodingError):
    """A valid message at the wrong moment: wrong round, stale base, no open session
    (FAILED_PRECONDITION)."""


class Overloaded(SplitDecodingError):
    """Over a capacity limit such as the session count (RESOURCE_EXHAUSTED)."""


class NotFound(SplitDecodingError):
    """A named thing the server does not have, such as an artifact (NOT_FOUND)."""


class Forbidden(SplitDecodingError):
    """A caller asking for what belongs to another, such as a session it did not open
    (PERMISSION_DENIED)."""


class Unavailable(SplitDecodingError):
    """The server cannot run the target any more, such as when a rank of a tensor-parallel
    target is gone; it is stopping (UNAVAILABLE)."""
