"""The batch service: submit, get, cancel and read the results of batches; the fronts are adapters.

It knows neither gRPC nor HTTP. A submission is the project's own message (``protos.SubmitBatchRequest``, used
as data); a refusal is a typed :class:`gateway.batches.errors.BatchError`; the caller is a
:class:`gateway.batches.errors.Caller` that the front established by its own authentication. The gRPC front
(:mod:`gateway.grpc_api.servicer`) and the OpenAI HTTP front (:mod:`gateway.http_api.front`) call it and map
its errors to their own codes. The admin API is :mod:`gateway.grpc_api.admin`.

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
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from gateway.assign.calibrated import LengthEstimates
from gateway.assign.cost import assign_batch
from gateway.assign.estimates import charged_tokens
from gateway.assign.listing import read_clusters
from gateway.assign.placement import configured_views, first_misfit
from gateway.assign.policies import ClusterView, NoClusterError, QueryLoad, queue_order
from gateway.assign.prefixes import prefixes_of
from gateway.assign.views import cluster_views
from gateway.batches import quota
from gateway.batches.deps import GatewayDeps
from gateway.batches.errors import Caller, InvalidRequest, NotFound, Unavailable
from gateway.batches.messages import fail_rows, fingerprint
from gateway.batches.parts import Staging, StreamBrokenOff, stage_parts
from gateway.batches.resubmit import check_resubmission
from gateway.checks.serving import Serving
from gateway.checks.validation import ON_BAD_QUERY, Checked, InvalidBatch, Limits, check_batch, id_problem
from gateway.checks.windows import WindowError, check_priority, parse_window
from gateway.intake.background import Intake, encode_rows
from gateway.intake.rows import queued_query, tenant_salt
from gateway.status.eta import Eta
from protos import fleetbatch_pb2 as pb
from workqueue import BatchInfo, ClusterInfo, QueryResult, QueuedQuery, StagedRowsMissing

log = logging.getLogger(__name__)

#: the largest start index of a results stream (2^53: exact as a JSON number; no batch holds as many)
MAX_START_INDEX = 2**53


@dataclass(frozen=True)
class BatchStatus:
    """A batch as the service answers it: its record and, while it runs, its ETA."""

    info: BatchInfo
    eta: Eta | None = None


class BatchService:
    def __init__(self, deps: GatewayDeps):
        self.d = deps
        self._policy_lock = threading.Lock()  # policies may keep state (round robin's cursor)
        self._limits = Limits.of(deps.config)
        self._client_lock = quota.ClientLocks()
        self.intake = Intake(
            deps.queue,
            deps.predict_tokens,
            self._assign,
            deps.intake,
            self._count_assigned,
            count_tokens=deps.count_tokens,
            wait_s=deps.config.intake_wait_s,
            order=lambda loads: queue_order(deps.policy, loads),
            find_prefixes=deps.find_prefixes,
            shared_cache=deps.config.shared_prefix_cache,
            assign_takes_batch=True,
        )

    def _count_assigned(self, names: list[str]) -> None:
        for n, k in Counter(names).items():  # one update per cluster, not per query
            self.d.metrics.queries.labels(n).inc(k)

    async def submit(self, request: pb.SubmitBatchRequest, caller: Caller) -> BatchStatus:
        """Validate, predict and assign a batch (or accept a large one for the background intake)."""
        d, cfg = self.d, self.d.config
        t0 = time.perf_counter()
        mode = request.on_bad_query or ON_BAD_QUERY[cfg.on_bad_query]
        large = len(request.queries) >= d.intake.sync_max_queries  # enqueued by the background intake
        limits = await self._limits_now()
        try:  # sizes first, then tokenizing: off the event loop
            checked = await asyncio.to_thread(
                check_batch,
                request,
                d.count_tokens,
                limits,
                fail_row=mode == pb.ON_BAD_QUERY_FAIL_ROW,
                bound=d.token_bound if large else None,
            )
            window_s = parse_window(request.completion_window)
            check_priority(request.priority)
        except (InvalidBatch, WindowError) as e:
            d.metrics.rejected.inc()
            log.info("rejected a batch of %d queries: %s", len(request.queries), e)
            raise InvalidRequest(str(e)) from None
        checked.window_s = window_s
        batch_id = request.batch_id or uuid.uuid4().hex
        if request.batch_id:
            existing = await asyncio.to_thread(d.queue.batch, batch_id)
            if existing is not None:
                return await self._resubmitted(existing, request, caller)
        return await self._within_quota(
            caller,
            batch_id,
            len(request.queries),
            lambda writes: self._create(request, checked, batch_id, caller, t0, writes),
        )

    async def submit_parts(
        self,
        parts: AsyncIterator[pb.SubmitBatchRequest],
        caller: Caller,
        broken: Callable[[], bool] = lambda: False,
    ) -> BatchStatus:
        """A batch sent in parts (``SubmitBatchStream``, :mod:`gateway.batches.parts`): each part is checked
        and staged in Redis as it arrives; when the stream ends, the batch is accepted for the background
        intake, as a large :meth:`submit`'s. A stream that breaks or is refused creates nothing: the batch is
        made only after a message with ``end_of_batch`` (a cancelled call's parts just stop coming; ``broken()``
        tells the client that left from one that half-closed too soon, which is answered)."""
        d, t0 = self.d, time.perf_counter()
        first = await anext(parts, None)
        if first is None:
            raise InvalidRequest("the stream ended before its first message: a batch needs queries")
        if first.batch_id and (problem := id_problem(first.batch_id, "batch_id")):
            raise InvalidRequest(problem)
        batch_id = first.batch_id or uuid.uuid4().hex
        existing = await asyncio.to_thread(d.queue.batch, batch_id) if first.batch_id else None
        if existing is None:
            await self._some_cluster_active()
        stage = None if existing is not None else Staging(d.queue, d.queue.new_stage(batch_id))
        created = False
        try:
            try:
                sent = await stage_parts(
                    first, parts, count_tokens=d.count_tokens, bound=d.token_bound,
                    limits=await self._limits_now(), default_mode=d.config.on_bad_query, stage=stage,
                )  # fmt: skip
            except StreamBrokenOff as e:
                if broken():  # the client is gone: nobody to answer
                    raise asyncio.CancelledError(str(e)) from None
                raise InvalidRequest(str(e)) from None
            if existing is not None:
                return await self._resubmitted_as(existing, caller, first, sent.total, sent.digest)

            async def create(writes) -> BatchStatus:
                nonlocal created
                create_from = partial(  # called with the staging list's key
                    d.queue.accept_staged, batch_id, total=sent.total, policy=d.policy.name,
                    metadata=dict(first.metadata), fingerprint=sent.digest, extra=writes,
                    window_s=sent.window_s, priority=first.priority,
                )  # fmt: skip
                try:
                    created = await stage.accept(create_from)
                except StagedRowsMissing as e:
                    raise Unavailable(str(e)) from None
                what = f"{sent.total} queries in {sent.parts} parts"
                return await self._accepted(
                    batch_id, created, caller, first, sent.total, sent.digest, what, t0
                )

            return await self._within_quota(caller, batch_id, sent.total, create)
        except InvalidRequest:
            d.metrics.rejected.inc()
            raise
        finally:
            if stage is not None and not created:  # not awaited: a cancelled call (the client broke
                stage.drop()  # off, the gateway stops) must still drop it

    async def _limits_now(self) -> Limits:
        """The gateway's limits, with what the clusters serve now (models, OpenAI fields)."""
        return replace(self._limits, serving=Serving.of(await asyncio.to_thread(read_clusters, self.d.queue)))

    async def _within_quota(
        self, caller: Caller, batch_id: str, count: int, create: Callable[[Any], Awaitable[BatchStatus]]
    ) -> BatchStatus:
        cap = self.d.config.max_queued_per_client
        return await quota.within_quota(
            self.d.queue, self._client_lock, cap, caller, batch_id, count, create, self.d.metrics.rejected.inc
        )

    async def _create(
        self,
        request: pb.SubmitBatchRequest,
        checked: Checked,
        batch_id: str,
        caller: Caller,
        t0: float,
        writes,
    ) -> BatchStatus:
        d = self.d
        if checked.uncounted or len(request.queries) >= d.intake.sync_max_queries:
            return await self._accept(request, checked, batch_id, caller, t0, writes)
        salt = tenant_salt(caller.owner, d.config.shared_prefix_cache)  # the owner creation_writes names
        queued, names = await self._assign_all(request, checked, batch_id, salt)
        digest = await asyncio.to_thread(fingerprint, request)  # hashes every query: off the loop
        created = await asyncio.to_thread(
            d.queue.create_batch,
            batch_id,
            list(zip(queued, names, strict=True)),
            policy=d.policy.name,
            metadata=dict(request.metadata),
            fingerprint=digest,
            extra=writes,
            window_s=checked.window_s,
            priority=request.priority,
        )
        if created and checked.bad:
            await asyncio.to_thread(fail_rows, d.queue, batch_id, request, checked.bad)
        info = await asyncio.to_thread(d.queue.batch, batch_id)
        if not created:  # a concurrent submission with the same id won
            return await self._resubmitted(info, request, caller)
        d.metrics.batches.inc()
        self._count_assigned(names)
        elapsed = time.perf_counter() - t0
        d.metrics.assign_seconds.observe(elapsed)
        log.info(
            "batch %s: %d queries assigned by %s in %.3f s (%d bad, failed alone): %s",
            batch_id,
            len(queued),
            d.policy.name,
            elapsed,
            len(checked.bad),
            ", ".join(f"{c}={n}" for c, n in sorted(info.queries_per_cluster.items())),
        )
        return BatchStatus(
            info, d.eta.at_submit(d.queue.clock(), info, sum(q.charged_tokens for q in queued))
        )

    async def _accept(
        self,
        request: pb.SubmitBatchRequest,
        checked: Checked,
        batch_id: str,
        caller: Caller,
        t0: float,
        writes,
    ) -> BatchStatus:
        """A large batch: store its validated rows and answer VALIDATING; :mod:`gateway.intake.background` enqueues it."""
        d = self.d
        await self._some_cluster_active()  # with one, intake waits (bounded) for it to accept work
        rows = encode_rows(request, checked)  # encoded slice by slice while stored
        digest = await asyncio.to_thread(fingerprint, request)  # hashes every query: off the loop
        created = await asyncio.to_thread(
            d.queue.accept_batch, batch_id, rows, policy=d.policy.name, metadata=dict(request.metadata),
            fingerprint=digest, extra=writes, window_s=checked.window_s, priority=request.priority,
        )  # fmt: skip
        what = f"{len(rows)} queries ({len(checked.bad)} bad, failed alone)"
        return await self._accepted(batch_id, created, caller, request, len(rows), digest, what, t0)

    async def _some_cluster_active(self) -> None:
        if not configured_views(await asyncio.to_thread(read_clusters, self.d.queue)):
            raise Unavailable("cannot assign the batch: no cluster is active (all draining or removed)")

    async def _accepted(
        self,
        batch_id: str,
        created: bool,
        caller: Caller,
        settings,
        total: int,
        digest: str,
        what: str,
        t0: float,
    ) -> BatchStatus:
        """The batch accepted for the background intake (``created``: by this call, else by a concurrent
        submission of the same id, which this one must match)."""
        info = await asyncio.to_thread(self.d.queue.batch, batch_id)
        if not created:
            return await self._resubmitted_as(info, caller, settings, total, digest)
        self.intake.wake()
        self.d.metrics.batches.inc()
        log.info(
            "batch %s: %s accepted in %.3f s; intake in the background",
            batch_id,
            what,
            time.perf_counter() - t0,
        )
        return BatchStatus(info)

    async def _assign_all(
        self, request: pb.SubmitBatchRequest, checked: Checked, batch_id: str, salt: str = ""
    ) -> tuple[list[QueuedQuery], list[str]]:
        """Predict and assign the good queries; bad ones (fail-row) go last, inert, on the last cluster used."""
        d = self.d
        good = [i for i in range(len(request.queries)) if i not in checked.bad]
        prompts = [request.queries[i].prompt for i in good]
        estimates = LengthEstimates.of(await asyncio.to_thread(d.predict_tokens, prompts))
        predicted, raw_of = estimates.tokens, dict(zip(good, estimates.raw, strict=True))
        counts = [checked.prompt_tokens[i] for i in good]
        shared = await asyncio.to_thread(prefixes_of, d.find_prefixes, prompts, counts)
        loads = [
            QueryLoad(request.queries[i].id, n, float(min(p, checked.max_tokens[i])), *prefix)
            for i, n, p, prefix in zip(good, counts, predicted, shared, strict=True)
        ]
        infos = await asyncio.to_thread(read_clusters, d.queue)
        try:
            views = cluster_views(infos)
            names = await asyncio.to_thread(self._assign, loads, views, batch_id, checked.window_s)
        except NoClusterError as e:
            never = first_misfit(loads, infos)  # permanent: no configured cluster can ever take it
            refusal = InvalidRequest if never else Unavailable
            raise refusal(f"cannot assign the batch: {never or e}") from None
        queued = []
        order = queue_order(d.policy, loads)  # the policy's queue order: longest first for the token ones
        names = [names[j] for j in order]
        charges = charged_tokens([loads[j] for j in order], names)  # a group's prefix once per cluster
        for charge, i, load in ((c, good[j], loads[j]) for c, j in zip(charges, order, strict=True)):
            q = request.queries[i]
            cached = round(load.total_tokens - charge)
            sizes = (checked.max_tokens[i], load.prompt_tokens, load.predicted_tokens, cached)
            queued.append(queued_query(batch_id, q, *sizes, salt, raw_of[i]))
        for i in sorted(checked.bad):  # inert: an engine that claimed one first would refuse max_tokens 0
            q = request.queries[i]
            queued.append(QueuedQuery(batch_id, q.id, "", 0, 0, 0.0))
            names.append(names[-1])
        return queued, names

    def _assign(self, loads: Sequence[QueryLoad], views, batch_id="", window_s=None) -> list[str]:
        with self._policy_lock:  # the cost policy reads the batch's window: given, else its stored deadline's
            return assign_batch(self.d.policy, loads, views, window_s, batch_id, self.d.queue)

    async def _resubmitted(self, existing: BatchInfo, request, caller: Caller) -> BatchStatus:
        """``request`` under an existing batch's id: :meth:`_resubmitted_as` with its count and fingerprint."""
        digest = await asyncio.to_thread(fingerprint, request) if existing.fingerprint else ""
        return await self._resubmitted_as(existing, caller, request, len(request.queries), digest)

    async def _resubmitted_as(
        self, existing: BatchInfo, caller: Caller, settings: pb.SubmitBatchRequest, total: int, digest: str
    ) -> BatchStatus:
        """The existing batch, if the submission matches it (the rule: :mod:`gateway.batches.resubmit`)."""
        await check_resubmission(self.d.queue, existing, caller, settings, total, digest)
        return BatchStatus(existing, self.d.eta.get(existing.batch_id))

    async def _info(self, batch_id: str, caller: Caller) -> BatchInfo:
        problem = id_problem(batch_id, "batch_id")
        if problem:
            raise InvalidRequest(problem)
        info, h = (await asyncio.to_thread(self.d.queue.batches, [batch_id]))[batch_id]  # one round trip
        if info is None or not quota.owner_allows(h.get(quota.OWNER_FIELD), caller.owner):
            raise NotFound(f"no batch {batch_id!r}")
        return info

    async def get(self, batch_id: str, caller: Caller) -> BatchStatus:
        """The batch and its ETA (``NotFound`` for one the caller may not see)."""
        return BatchStatus(await self._info(batch_id, caller), self.d.eta.get(batch_id))

    async def cancel(self, batch_id: str, caller: Caller) -> BatchStatus:
        """Ask the batch to stop: its queued queries go at once, running ones at their workers' next tick."""
        await self._info(batch_id, caller)
        removed = await asyncio.to_thread(self.d.queue.cancel_batch, batch_id)
        log.info("batch %s: cancel requested, %d queued queries removed", batch_id, max(removed, 0))
        return BatchStatus(await self._info(batch_id, caller))

    async def results(
        self, batch_id: str, start_index: int, follow: bool, caller: Caller
    ) -> AsyncIterator[QueryResult]:
        """The batch's results from ``start_index`` on, in the order they were written; ``follow``: until
        the batch is final and every result has been read."""
        await self._info(batch_id, caller)
        if not 0 <= start_index <= MAX_START_INDEX:  # past it, Redis's list ranges would overflow
            raise InvalidRequest(f"start_index must be in 0..{MAX_START_INDEX}, got {start_index}")
        idx = start_index
        q = self.d.queue
        while True:
            rows = await asyncio.to_thread(q.query_results, batch_id, idx, idx + 499)
            for r in rows:
                yield r
            idx += len(rows)
            if rows:
                continue
            info = await asyncio.to_thread(q.batch, batch_id)
            if not follow or info is None:
                return
            if info.final:
                if await asyncio.to_thread(q.result_count, batch_id) <= idx:
                    return
                continue
            await asyncio.sleep(0.05)

    async def clusters(self) -> list[tuple[ClusterInfo, ClusterView]]:
        """Every listed cluster with its view (capacity, pending work) as assignment sees it."""
        infos = await asyncio.to_thread(read_clusters, self.d.queue, listed=True)
        views = cluster_views(infos)
        self.d.metrics.observe_clusters(infos, views)
        return list(zip(infos, views, strict=True))
