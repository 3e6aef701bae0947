"""gRPC servicers: the client batch API and the token-guarded admin API.

Blocking work (tokenizing, predicting, Redis round trips) runs in worker threads via
``asyncio.to_thread`` so the event loop keeps serving streams while a large batch is
being assigned.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.offload import LinkCost
from gateway.policies import AssignmentPolicy, NoClusterError, QueryLoad
from gateway.rebalance import format_plan, plan_rebalance, simulate_moves
from gateway.validation import InvalidBatch, validate_batch
from gateway.views import cluster_proto, cluster_views, queued_loads, view_proto
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from workqueue import BatchInfo, QueuedQuery, WorkQueue

log = logging.getLogger(__name__)

STATUS = {
    "validating": pb.VALIDATING,
    "in_progress": pb.IN_PROGRESS,
    "completed": pb.COMPLETED,
    "failed": pb.FAILED,
    "cancelling": pb.CANCELLING,
    "cancelled": pb.CANCELLED,
}


@dataclass
class GatewayDeps:
    """Everything the servicers use; built once by the server."""

    config: GatewayConfig
    queue: WorkQueue
    count_tokens: Callable[[list[str]], list[int]]
    predict_tokens: Callable[[list[str]], list[float]]
    policy: AssignmentPolicy
    metrics: GatewayMetrics
    links: LinkCost = LinkCost()
    predictor: object | None = None  # the LengthPredictor, kept for hot reload


def batch_proto(b: BatchInfo) -> pb.Batch:
    return pb.Batch(
        id=b.batch_id,
        status=STATUS.get(b.status, pb.BATCH_STATUS_UNSPECIFIED),
        request_counts=pb.RequestCounts(
            total=b.total, completed=b.completed, failed=b.failed, cancelled=b.cancelled
        ),
        created_at=b.created_at,
        completed_at=b.completed_at,
        metadata=b.metadata,
        queries_per_cluster=b.queries_per_cluster,
        predicted_tokens_per_cluster=b.predicted_tokens_per_cluster,
        policy=b.policy,
    )


def result_proto(r: dict) -> pb.QueryResult:
    t = r.get("timings") or {}
    return pb.QueryResult(
        batch_id=r.get("batch_id", ""),
        query_id=r.get("query_id", ""),
        text=r.get("text", ""),
        prompt_tokens=int(r.get("prompt_tokens", 0)),
        completion_tokens=int(r.get("completion_tokens", 0)),
        cluster=r.get("cluster", ""),
        timings=pb.Timings(
            enqueued_at=float(t.get("enqueued_at", 0)),
            started_at=float(t.get("started_at", 0)),
            first_token_at=float(t.get("first_token_at", 0)),
            finished_at=float(t.get("finished_at", 0)),
        ),
        finish_reason=r.get("finish_reason", ""),
        error=r.get("error", ""),
        predicted_tokens=float(r.get("predicted_tokens") or 0),
        index=int(r.get("index", 0)),
        attempts=int(r.get("attempts", 0)),
    )


class BatchService(pb_grpc.BatchServiceServicer):
    def __init__(self, deps: GatewayDeps):
        self.d = deps
        self._policy_lock = threading.Lock()  # policies may keep state (round robin's cursor)

    async def SubmitBatch(
        self, request: pb.SubmitBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.Batch:
        d, cfg = self.d, self.d.config
        t0 = time.perf_counter()
        prompts = [q.prompt for q in request.queries]
        prompt_tokens = await asyncio.to_thread(d.count_tokens, prompts) if prompts else []
        try:
            validate_batch(
                request,
                prompt_tokens,
                max_prompt_tokens=cfg.max_prompt_tokens,
                max_max_tokens=cfg.max_max_tokens,
                max_batch_queries=cfg.max_batch_queries,
            )
        except InvalidBatch as e:
            d.metrics.rejected.inc()
            log.info("rejected a batch of %d queries: %s", len(prompts), e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        batch_id = request.batch_id or uuid.uuid4().hex
        if request.batch_id:
            existing = await asyncio.to_thread(d.queue.batch, batch_id)
            if existing is not None:
                return await self._resubmitted(existing, request, context)
        predicted = await asyncio.to_thread(d.predict_tokens, prompts)
        max_tokens = [q.max_tokens or cfg.default_max_tokens for q in request.queries]
        loads = [
            QueryLoad(q.id, pt, float(min(p, mt)))
            for q, pt, p, mt in zip(request.queries, prompt_tokens, predicted, max_tokens, strict=True)
        ]
        infos = await asyncio.to_thread(d.queue.clusters)
        views = cluster_views(infos)
        try:
            names = await asyncio.to_thread(self._assign, loads, views)
        except NoClusterError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot assign the batch: {e}")
        queued = [
            QueuedQuery(
                batch_id=batch_id,
                query_id=q.id,
                prompt=q.prompt,
                max_tokens=mt,
                prompt_tokens=load.prompt_tokens,
                predicted_tokens=load.predicted_tokens,
                temperature=q.sampling.temperature,
                top_p=q.sampling.top_p or 1.0,
                seed=q.sampling.seed if q.sampling.HasField("seed") else None,
                forced_length=q.forced_length if q.HasField("forced_length") else None,
                metadata=dict(q.metadata),
            )
            for q, load, mt in zip(request.queries, loads, max_tokens, strict=True)
        ]
        created = await asyncio.to_thread(
            d.queue.create_batch,
            batch_id,
            list(zip(queued, names, strict=True)),
            policy=d.policy.name,
            metadata=dict(request.metadata),
        )
        info = await asyncio.to_thread(d.queue.batch, batch_id)
        if not created:  # a concurrent submission with the same id won
            return await self._resubmitted(info, request, context)
        d.metrics.batches.inc()
        for n in names:
            d.metrics.queries.labels(n).inc()
        elapsed = time.perf_counter() - t0
        d.metrics.assign_seconds.observe(elapsed)
        log.info(
            "batch %s: %d queries assigned by %s in %.3f s: %s",
            batch_id,
            len(queued),
            d.policy.name,
            elapsed,
            ", ".join(f"{c}={n}" for c, n in sorted(info.queries_per_cluster.items())),
        )
        return batch_proto(info)

    def _assign(self, loads: Sequence[QueryLoad], views) -> list[str]:
        with self._policy_lock:
            return self.d.policy.assign(loads, views)

    async def _resubmitted(self, existing: BatchInfo, request, context) -> pb.Batch:
        if existing.total != len(request.queries):
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"batch {existing.batch_id} exists with {existing.total} queries, this submission has {len(request.queries)}",
            )
        return batch_proto(existing)

    async def _get(self, batch_id: str, context) -> BatchInfo:
        if not batch_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "batch_id is empty")
        info = await asyncio.to_thread(self.d.queue.batch, batch_id)
        if info is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no batch {batch_id!r}")
        return info

    async def GetBatch(self, request: pb.GetBatchRequest, context) -> pb.Batch:
        return batch_proto(await self._get(request.batch_id, context))

    async def CancelBatch(self, request: pb.CancelBatchRequest, context) -> pb.Batch:
        await self._get(request.batch_id, context)
        removed = await asyncio.to_thread(self.d.queue.cancel_batch, request.batch_id)
        log.info("batch %s: cancel requested, %d queued queries removed", request.batch_id, max(removed, 0))
        return batch_proto(await self._get(request.batch_id, context))

    async def StreamResults(self, request: pb.StreamResultsRequest, context) -> AsyncIterator[pb.QueryResult]:
        await self._get(request.batch_id, context)
        if request.start_index < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "start_index must be >= 0")
        idx = request.start_index
        q = self.d.queue
        while True:
            rows = await asyncio.to_thread(q.results, request.batch_id, idx, idx + 499)
            for r in rows:
                yield result_proto(r)
            idx += len(rows)
            if rows:
                continue
            info = await asyncio.to_thread(q.batch, request.batch_id)
            if not request.follow or info is None:
                return
            if info.final:
                if await asyncio.to_thread(q.result_count, request.batch_id) <= idx:
                    return
                continue
            await asyncio.sleep(0.05)

    async def ListClusters(self, request, context) -> pb.ListClustersResponse:
        infos = await asyncio.to_thread(self.d.queue.clusters)
        views = cluster_views(infos)
        self.d.metrics.observe_clusters(infos, views)
        return pb.ListClustersResponse(
            clusters=[cluster_proto(i, v) for i, v in zip(infos, views, strict=True)]
        )


class AdminService(pb_grpc.AdminServiceServicer):
    """Rebalance, drain, add and remove clusters. Every call needs ``authorization: Bearer <token>``."""

    def __init__(self, deps: GatewayDeps):
        self.d = deps

    async def _authorize(self, context) -> None:
        token = self.d.config.token()
        if not token:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, "the admin API is disabled: no admin token configured"
            )
        given = dict(context.invocation_metadata()).get("authorization", "")
        if given != f"Bearer {token}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong admin token")

    async def GetClusterStatus(self, request, context) -> pb.ListClustersResponse:
        await self._authorize(context)
        infos = await asyncio.to_thread(self.d.queue.clusters)
        views = cluster_views(infos)
        return pb.ListClustersResponse(
            clusters=[cluster_proto(i, v) for i, v in zip(infos, views, strict=True)]
        )

    def _rebalance(self, drain: Sequence[str], dry_run: bool) -> pb.RebalanceResponse:
        q = self.d.queue
        infos = q.clusters()
        names = {i.name for i in infos}
        unknown = [n for n in drain if n not in names]
        if unknown:
            raise KeyError(f"unknown cluster(s): {', '.join(unknown)}")
        views = cluster_views(infos)
        queued = {i.name: queued_loads(q, i.name) for i in infos}
        moves = plan_rebalance(views, queued, drain=drain, links=self.d.links)
        after, _ = simulate_moves(views, queued, moves)
        resp = pb.RebalanceResponse(
            before=[cluster_proto(i, v) for i, v in zip(infos, views, strict=True)],
            after=[view_proto(v) for v in after],
            applied=not dry_run,
            message=format_plan(views, after, moves),
        )
        for m in moves:
            moved = 0
            if not dry_run:
                moved, _ = q.move_tail(m.src, m.dst, m.count)
                self.d.metrics.moves.labels(m.src, m.dst).inc(moved)
                log.info("rebalance: moved %d/%d queries %s -> %s", moved, m.count, m.src, m.dst)
            resp.moves.append(
                pb.Move(src=m.src, dst=m.dst, count=m.count, predicted_tokens=m.tokens, moved=moved)
            )
        return resp

    async def _run_rebalance(self, context, drain: Sequence[str], dry_run: bool) -> pb.RebalanceResponse:
        try:
            return await asyncio.to_thread(self._rebalance, drain, dry_run)
        except KeyError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        except NoClusterError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    async def Rebalance(self, request: pb.RebalanceRequest, context) -> pb.RebalanceResponse:
        await self._authorize(context)
        return await self._run_rebalance(context, list(request.drain), request.dry_run)

    async def DrainCluster(self, request: pb.DrainClusterRequest, context) -> pb.RebalanceResponse:
        await self._authorize(context)
        if not request.name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "cluster name is empty")
        if request.name not in await asyncio.to_thread(self.d.queue.cluster_names):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown cluster(s): {request.name}")
        if not request.dry_run:  # stop new assignments first, then move the queue away
            await asyncio.to_thread(self.d.queue.set_cluster_state, request.name, "draining")
            log.info("cluster %s is draining", request.name)
        return await self._run_rebalance(context, [request.name], request.dry_run)

    async def AddCluster(self, request: pb.AddClusterRequest, context) -> pb.ClusterStatus:
        await self._authorize(context)
        try:
            await asyncio.to_thread(
                self.d.queue.register_cluster,
                request.name,
                capacity_hint_tps=request.capacity_tokens_per_s or None,
                backend=request.backend or None,
                max_query_tokens=request.max_query_tokens or None,
                kv_budget_tokens=request.kv_budget_tokens or None,
                state="active",
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.info(
            "cluster %s added (capacity hint %.1f tokens/s)", request.name, request.capacity_tokens_per_s
        )
        infos = await asyncio.to_thread(self.d.queue.clusters, [request.name])
        return cluster_proto(infos[0], cluster_views(infos)[0])

    async def RemoveCluster(self, request: pb.RemoveClusterRequest, context) -> pb.RebalanceResponse:
        await self._authorize(context)
        infos = await asyncio.to_thread(self.d.queue.clusters, [request.name])
        if (
            not request.name
            or infos[0].state == "removed"
            or request.name not in await asyncio.to_thread(self.d.queue.cluster_names)
        ):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no cluster {request.name!r}")
        if infos[0].inflight > 0 and not request.force and not request.dry_run:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cluster {request.name} has {infos[0].inflight} running queries; drain it first or pass force",
            )
        if not request.dry_run:  # stop new assignments first, then move the queue away
            await asyncio.to_thread(self.d.queue.set_cluster_state, request.name, "removed")
            log.info("cluster %s removed", request.name)
        return await self._run_rebalance(context, [request.name], request.dry_run)
