"""Interceptors: Redis trouble becomes ``UNAVAILABLE`` and undecodable requests ``INVALID_ARGUMENT``.

Never ``UNKNOWN``. One interceptor wraps every handler of the gateway: a Redis connection error, timeout, "still
loading its data" error (``BusyLoadingError`` is a ``ConnectionError``) or a reply for a state that passes (``BUSY``
running a script, a failover: :func:`gateway.batches.errors.redis_down`) raised while a call is
served aborts the call with ``UNAVAILABLE`` and a message that says Redis is the cause, so client
retry policies (which retry ``UNAVAILABLE``) work through a Redis restart.

The other wraps the request deserializer of every method: bytes that do not parse as the
method's request message (invalid UTF-8 in a string field, a truncated or corrupt message)
answer ``INVALID_ARGUMENT`` naming the request type, instead of a ``DecodeError`` stack trace.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.message import DecodeError
from redis.exceptions import ResponseError

from gateway.batches.errors import REDIS_DOWN, redis_down

#: what a Redis call raises that may say Redis is down, slow or busy (redis_down decides)
REDIS_TROUBLE = (*REDIS_DOWN, ResponseError)

log = logging.getLogger(__name__)


def _message(e: Exception) -> str:
    return f"the queue store (Redis) is unavailable, retry later: {type(e).__name__}: {e}"


def _unary(behavior):
    async def wrapped(request, context):
        try:
            return await behavior(request, context)
        except REDIS_TROUBLE as e:
            if not redis_down(e):
                raise
            log.warning("call failed on Redis: %s", e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, _message(e))

    return wrapped


def _stream(behavior):
    async def wrapped(request, context):
        try:
            async for item in behavior(request, context):
                yield item
        except REDIS_TROUBLE as e:
            if not redis_down(e):
                raise
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
        if handler.stream_unary is not None:  # the request is a stream of messages; the answer one
            return grpc.stream_unary_rpc_method_handler(
                _unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer
            )
        return handler


class _Undecodable:
    """What the deserializer returns for bytes that are not a valid request."""

    def __init__(self, type_name: str, error: DecodeError) -> None:
        self.message = (
            f"the request is not a valid {type_name}: a string field (a prompt, an id, metadata) is not "
            f"valid UTF-8, or the bytes are corrupt or truncated ({error})"
        )


def _safe_deserializer(deserialize, type_name: str):
    def wrapped(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as e:
            return _Undecodable(type_name, e)

    return wrapped


def _reject_undecodable_unary(behavior):
    async def wrapped(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return wrapped


def _reject_undecodable_stream(behavior):
    async def wrapped(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        async for item in behavior(request, context):
            yield item

    return wrapped


def _reject_undecodable_parts(behavior):
    """A stream of requests: the first message that does not decode ends the call (``INVALID_ARGUMENT``)."""

    async def wrapped(requests, context):
        async def checked():
            async for request in requests:
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                yield request

        return await behavior(checked(), context)

    return wrapped


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Requests of ``file``'s services that cannot be decoded are ``INVALID_ARGUMENT``."""

    def __init__(self, file: FileDescriptor) -> None:
        self.inputs = {
            f"/{svc.full_name}/{m.name}": m.input_type.full_name
            for svc in file.services_by_name.values()
            for m in svc.methods
        }

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        type_name = self.inputs.get(handler_call_details.method)
        if handler is None or type_name is None or handler.request_deserializer is None:
            return handler
        deserialize = _safe_deserializer(handler.request_deserializer, type_name)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _reject_undecodable_unary(handler.unary_unary), deserialize, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _reject_undecodable_stream(handler.unary_stream), deserialize, handler.response_serializer
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _reject_undecodable_parts(handler.stream_unary), deserialize, handler.response_serializer
            )
        return handler
