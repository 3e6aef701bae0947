"""The gRPC front of the batch service: ``fleetbatch.v1.BatchService`` over :class:`gateway.batches.service.BatchService`.

A thin adapter. It says who calls (the client its Bearer token names, checked before by
:class:`gateway.grpc_api.auth.AuthInterceptor`; without client tokens, the ``x-client-id`` header or the
peer's address for the per-client cap), turns the service's answers into messages and its typed
errors into status codes (:data:`STATUS`). Redis trouble is ``UNAVAILABLE`` by the server's
interceptor (:mod:`gateway.grpc_api.interceptors`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from gateway.assign.views import cluster_proto
from gateway.batches import quota
from gateway.batches.errors import (
    BatchError,
    Caller,
    Conflict,
    InvalidRequest,
    NotFound,
    QuotaExceeded,
    Unavailable,
)
from gateway.batches.messages import batch_proto, result_proto
from gateway.batches.service import BatchService, BatchStatus
from gateway.grpc_api.auth import Authenticator
from gateway.status.cost import priced
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc

#: the service's refusals as gRPC status codes
STATUS: dict[type[BatchError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Conflict: grpc.StatusCode.ALREADY_EXISTS,
    QuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}


def caller_of(auth: Authenticator, context: grpc.aio.ServicerContext) -> Caller:
    """Who calls: the client its token names; else (a gateway without client tokens) no owner, and
    the ``x-client-id`` header's client or the peer's address for the per-client cap."""
    metadata = context.invocation_metadata() or ()
    client = auth.client(metadata)
    if client is not None:
        return Caller(client, client)
    return quota.unproven_caller(None, dict(metadata), context.peer())


class BatchServicer(pb_grpc.BatchServiceServicer):
    def __init__(self, service: BatchService, auth: Authenticator) -> None:
        self.service, self.auth = service, auth

    async def _answer(self, work, context: grpc.aio.ServicerContext) -> pb.Batch:
        try:
            status: BatchStatus = await work
        except BatchError as e:
            await context.abort(STATUS[type(e)], str(e))
        return batch_proto(status.info, status.eta, self.service.d.eta.cost.batch(status.info.batch_id))

    async def SubmitBatch(
        self, request: pb.SubmitBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.Batch:
        return await self._answer(self.service.submit(request, caller_of(self.auth, context)), context)

    async def SubmitBatchStream(
        self, request_iterator: AsyncIterator[pb.SubmitBatchRequest], context: grpc.aio.ServicerContext
    ) -> pb.Batch:
        caller = caller_of(self.auth, context)
        parts = self.service.submit_parts(aiter(request_iterator), caller, broken=context.cancelled)
        return await self._answer(parts, context)

    async def GetBatch(self, request: pb.GetBatchRequest, context: grpc.aio.ServicerContext) -> pb.Batch:
        return await self._answer(self.service.get(request.batch_id, caller_of(self.auth, context)), context)

    async def CancelBatch(
        self, request: pb.CancelBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.Batch:
        return await self._answer(
            self.service.cancel(request.batch_id, caller_of(self.auth, context)), context
        )

    async def StreamResults(
        self, request: pb.StreamResultsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.QueryResult]:
        caller = caller_of(self.auth, context)
        rows = self.service.results(request.batch_id, request.start_index, request.follow, caller)
        try:
            async for r in rows:
                yield result_proto(r)
        except BatchError as e:
            await context.abort(STATUS[type(e)], str(e))

    async def ListClusters(self, request, context: grpc.aio.ServicerContext) -> pb.ListClustersResponse:
        rows = await self.service.clusters()
        return priced(
            pb.ListClustersResponse(clusters=[cluster_proto(i, v) for i, v in rows]), self.service.d.eta.cost
        )
