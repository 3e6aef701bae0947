"""A bound on the request bytes the gateway decodes and handles at once (``--max-inflight-mb``).

gRPC bounds one message (``--max-request-mb``) and the calls served at once
(``--max-concurrent-rpcs``); this bounds their sum. A request is counted from the moment its
bytes are decoded until its handler returns. One that would take the total past the limit is
not decoded: it answers ``RESOURCE_EXHAUSTED`` (retry later), so a few clients sending the
largest batches at once cannot make the gateway hold many decoded copies of them. A request
larger than the whole limit is still served when nothing else is in flight. The HTTP front's
batch creations are counted in the same budget, as their input file's bytes (:class:`gateway.http_front.OpenAIFront`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Awaitable, Callable

import grpc


class InflightBytes:
    """A counter of bytes in flight with a limit (thread-safe)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def acquire(self, n: int) -> bool:
        with self._lock:
            if self.used > 0 and self.used + n > self.limit:
                return False
            self.used += n
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self.used -= n

    def refusal(self, n: int) -> str:
        """What a request of ``n`` bytes that did not fit is told."""
        return (
            f"the gateway is handling {self.used} request bytes (limit {self.limit}, "
            f"--max-inflight-mb); this request has {n}: retry later"
        )


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
