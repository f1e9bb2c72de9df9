"""Domain errors become gRPC status codes here and nowhere else (shared/errors.py).

The service's handlers are wrapped once: a domain error ends the call with its status and
message, a broken stream ends it quietly, anything else is a bug, logged and INTERNAL.
"""
from __future__ import annotations

import asyncio
import functools
import logging

import grpc

from cloud_server.rpc.client_stream import StreamBroken
from cloud_server.rpc.metrics import Metrics
from shared.errors import (
    Forbidden, InvalidRequest, NotFound, OutOfOrder, Overloaded, SplitDecodingError, Unavailable,
)

log = logging.getLogger(__name__)
STATUS_OF = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    OutOfOrder: grpc.StatusCode.FAILED_PRECONDITION,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Forbidden: grpc.StatusCode.PERMISSION_DENIED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}


async def _abort(metrics: Metrics, context, err: Exception, handler_name: str) -> None:
    """Ends the call with the status a domain error maps to, with its message; anything else
    is a bug on our side: logged, and INTERNAL for the caller."""
    if isinstance(err, SplitDecodingError):
        metrics.refused.labels(STATUS_OF[type(err)].name.lower()).inc()
        await context.abort(STATUS_OF[type(err)], str(err))
    metrics.refused.labels("internal").inc()
    log.exception("internal error in %s", handler_name)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {err}")


def grpc_status(handler):
    """Maps what a unary or stream-in handler raises to a gRPC status (see _abort)."""
    @functools.wraps(handler)
    async def wrapped(self, request, context):
        try:
            return await handler(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except StreamBroken:
            return None
        except Exception as err:  # noqa: BLE001 - the boundary: the server must keep serving
            await _abort(self.metrics, context, err, handler.__name__)
    return wrapped


def grpc_status_stream(handler):
    """grpc_status for a handler that yields its responses (server streaming)."""
    @functools.wraps(handler)
    async def wrapped(self, request, context):
        try:
            async for response in handler(self, request, context):
                yield response
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as err:  # noqa: BLE001 - the boundary: the server must keep serving
            await _abort(self.metrics, context, err, handler.__name__)
    return wrapped
