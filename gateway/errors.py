"""Redis trouble becomes gRPC ``UNAVAILABLE`` (retryable), never ``UNKNOWN``.

An interceptor wraps every handler of the gateway: a Redis connection error, timeout or "still
loading its data" error (``BusyLoadingError`` is a ``ConnectionError``) raised while a call is
served aborts the call with ``UNAVAILABLE`` and a message that says Redis is the cause, so client
retry policies (which retry ``UNAVAILABLE``) work through a Redis restart.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc
import redis

log = logging.getLogger(__name__)

REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def _message(e: Exception) -> str:
    return f"the queue store (Redis) is unavailable, retry later: {type(e).__name__}: {e}"


def _unary(behavior):
    async def wrapped(request, context):
        try:
            return await behavior(request, context)
        except REDIS_DOWN as e:
            log.warning("call failed on Redis: %s", e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, _message(e))

    return wrapped


def _stream(behavior):
    async def wrapped(request, context):
        try:
            async for item in behavior(request, context):
                yield item
        except REDIS_DOWN as e:
            log.warning("stream failed on Redis: %s", e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, _message(e))

    return wrapped


class RedisUnavailableInterceptor(grpc.aio.ServerInterceptor):
    """Maps Redis outages in the handlers of services under ``package`` to ``UNAVAILABLE``."""

    def __init__(self, package: str) -> None:
        self.prefix = f"/{package}."

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefix):
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        return handler
