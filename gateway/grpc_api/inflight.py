"""The gRPC side of ``--max-inflight-mb``: each unary call's request bytes are counted against the
gateway's :class:`gateway.batches.limits.InflightBytes` from decoding until its handler returns; a request
that does not fit is not decoded and answers ``RESOURCE_EXHAUSTED``."""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable

import grpc

from gateway.batches.limits import InflightBytes


class _Held:
    """A decoded request with the bytes it holds (given back by :meth:`release`, or when it is
    dropped unhandled), or a refusal (``request`` None) when it did not fit."""

    def __init__(self, request: object | None, size: int, budget: InflightBytes | None = None) -> None:
        self.request, self.size = request, size
        self.release = weakref.finalize(self, budget.release, size) if budget else (lambda: None)


class InflightBytesInterceptor(grpc.aio.ServerInterceptor):
    """Counts the request bytes of every unary call of ``package``'s services against ``budget``."""

    def __init__(self, budget: InflightBytes, package: str) -> None:
        self.budget, self.prefix = budget, f"/{package}."

    def _deserializer(self, deserialize):
        def wrapped(data: bytes) -> _Held:
            size = len(data)
            if not self.budget.acquire(size):
                return _Held(None, size)
            try:
                request = deserialize(data) if deserialize else data
            except BaseException:
                self.budget.release(size)
                raise
            return _Held(request, size, self.budget)

        return wrapped

    def _behavior(self, behavior):
        budget = self.budget

        async def wrapped(held: _Held, context):
            if held.request is None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, budget.refusal(held.size))
            try:
                return await behavior(held.request, context)
            finally:
                held.release()

        return wrapped

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None or not details.method.startswith(self.prefix):
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self._behavior(handler.unary_unary),
            self._deserializer(handler.request_deserializer),
            handler.response_serializer,
        )
