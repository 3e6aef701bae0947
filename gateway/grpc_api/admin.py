"""The token-guarded admin API: rebalance, drain, add and remove clusters.

Every call needs ``authorization: Bearer <token>``, compared in constant time. Admin input
(names, capacities, limits) is validated before anything is written: a bad value is
``INVALID_ARGUMENT`` and leaves Redis as it was. Adding a cluster that exists is
``ALREADY_EXISTS`` unless the request asks to ``update`` it. Removed clusters leave the
listing once nothing of theirs is queued or running.

Drains and rebalances move every queued query that fits on an accepting cluster; one that
fits on none stays where it is and the answer's ``message`` names it. Removing a cluster
that holds such a query is ``FAILED_PRECONDITION`` naming it, and changes nothing: the
cluster is not marked removed, so its engine can still run it (drain the cluster instead,
cancel the batch, or add a cluster the query fits on); a dry run answers the same. The check
reads the queue's last 20,000 ids: a query deeper in the queue, or assigned to the cluster just
before it was marked, is failed alone by the offloader if it fits on no active cluster
(:mod:`gateway.offload.offloader`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from gateway.assign.cost import SPOT_MARGIN
from gateway.assign.cost_moves import evacuation_rules
from gateway.assign.listing import read_clusters
from gateway.assign.loads import work_units
from gateway.assign.policies import NoClusterError
from gateway.assign.views import cluster_proto, cluster_views, queued_loads, view_proto
from gateway.checks.validation import cluster_problems, id_problem
from gateway.grpc_api.auth import admin_refusal
from gateway.offload.rebalance import Allowed, RebalancePlan, Split, format_plan, plan_moves, simulate_moves
from gateway.status.cost import priced
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from gateway.batches.deps import GatewayDeps

log = logging.getLogger(__name__)


MOVER_WAIT_S = 10.0  # how long an applied rebalance waits for the mover lease


class MoverBusy(RuntimeError):
    """The mover lease stayed taken (an offloader or another rebalance is moving work)."""


class WouldStrand(RuntimeError):
    """Removing the cluster would leave queued queries that fit on no other cluster."""


class AdminService(pb_grpc.AdminServiceServicer):
    """Rebalance, drain, add and remove clusters. Every call needs ``authorization: Bearer <token>``."""

    def __init__(self, deps: GatewayDeps):
        self.d = deps

    async def _authorize(self, context) -> None:
        """Again here (:class:`gateway.grpc_api.auth.AdminInterceptor` checks first), should a server lack it."""
        refusal = admin_refusal(context.invocation_metadata(), self.d.config.token())
        if refusal is not None:
            await context.abort(*refusal)

    async def _check_name(self, name: str, context, what: str = "cluster name") -> None:
        problem = id_problem(name, what)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)

    async def GetClusterStatus(self, request, context) -> pb.ListClustersResponse:
        await self._authorize(context)
        infos = await asyncio.to_thread(read_clusters, self.d.queue, listed=True)
        views = cluster_views(infos)
        rows = [cluster_proto(i, v) for i, v in zip(infos, views, strict=True)]
        return priced(pb.ListClustersResponse(clusters=rows), self.d.eta.cost)  # the billing model's figures

    def _rebalance(self, drain: Sequence[str], dry_run: bool, remove: str = "") -> pb.RebalanceResponse:
        """Plan (and unless ``dry_run``, apply) under the mover lease: one mover at a time, across
        the offloaders of every replica and other rebalances (:mod:`workqueue.mover`). With
        ``remove``, that cluster is marked removed only if it keeps no queued query (a dry run
        refuses as the real call would)."""
        if dry_run:
            return self._plan_and_apply(drain, dry_run, remove)
        lease = self.d.queue.mover_lease("rebalance", wait_s=MOVER_WAIT_S)
        with lease as held:
            if not held:
                raise MoverBusy(
                    f"another mover holds the lease ({lease.holder()}) after {MOVER_WAIT_S:g} s; retry"
                )
            return self._plan_and_apply(drain, dry_run, remove)

    def _cost_rules(self) -> tuple[Split, Allowed] | None:
        """Under the cost policy, its drain split and move rule (:func:`gateway.assign.cost_moves.evacuation_rules`), with
        the deadlines the ETA board last saw (None: not the cost policy)."""
        prices = getattr(self.d.policy, "prices", None)
        if prices is None:
            return None
        eta, spot = self.d.eta, getattr(self.d.policy, "spot", frozenset())
        deadlines = eta.deadlines_in_s(self.d.queue.clock())
        return evacuation_rules(
            prices,
            spot,
            pending_work_per_token=work_units(eta.prompt_share),
            deadlines_in_s=deadlines,
            spot_margin=getattr(self.d.policy, "spot_margin", SPOT_MARGIN),
        )

    def _plan_and_apply(self, drain: Sequence[str], dry_run: bool, remove: str = "") -> pb.RebalanceResponse:
        q = self.d.queue
        infos = read_clusters(q, listed=True, keep=drain)
        names = {i.name for i in infos}
        unknown = [n for n in drain if n not in names]
        if unknown:
            raise KeyError(f"unknown cluster(s): {', '.join(unknown)}")
        views = cluster_views(infos)
        queued = {i.name: queued_loads(q, i.name) for i in infos}
        split, allowed = self._cost_rules() or (None, None)
        plan = plan_moves(views, queued, drain=drain, links=self.d.links, split=split, allowed=allowed)
        if remove and plan.kept.get(remove):
            raise WouldStrand(
                f"cannot remove {remove}: "
                + "; ".join(RebalancePlan([], {remove: plan.kept[remove]}).kept_lines())
                + " (drain it instead, cancel their batches, or add a cluster they fit on)"
            )
        if remove and not dry_run:  # stop new assignments first, then move the queue away
            q.set_cluster_state(remove, "removed")
            log.info("cluster %s removed", remove)
        moves = plan.moves
        after, _ = simulate_moves(views, queued, moves)
        resp = pb.RebalanceResponse(
            before=[cluster_proto(i, v) for i, v in zip(infos, views, strict=True)],
            after=[view_proto(v) for v in after],
            applied=not dry_run,
            message=format_plan(views, after, moves, plan.kept_lines()),
        )
        for line in plan.kept_lines():
            log.warning("rebalance: %s", line)
        for m in moves:
            moved = 0
            if not dry_run:
                moved, _ = q.move_ids(m.src, m.dst, m.keys)
                self.d.metrics.moves.labels(m.src, m.dst).inc(moved)
                log.info("rebalance: moved %d/%d queries %s -> %s", moved, m.count, m.src, m.dst)
            resp.moves.append(
                pb.Move(src=m.src, dst=m.dst, count=m.count, predicted_tokens=m.tokens, moved=moved)
            )
        return resp

    async def _run_rebalance(
        self, context, drain: Sequence[str], dry_run: bool, remove: str = ""
    ) -> pb.RebalanceResponse:
        try:
            return await asyncio.to_thread(self._rebalance, drain, dry_run, remove)
        except KeyError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        except (NoClusterError, WouldStrand) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except MoverBusy as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def Rebalance(self, request: pb.RebalanceRequest, context) -> pb.RebalanceResponse:
        await self._authorize(context)
        for name in request.drain:
            await self._check_name(name, context, "drain: cluster name")
        return await self._run_rebalance(context, list(request.drain), request.dry_run)

    async def DrainCluster(self, request: pb.DrainClusterRequest, context) -> pb.RebalanceResponse:
        await self._authorize(context)
        await self._check_name(request.name, context)
        if not await self._exists(request.name):  # a removed cluster stays removed
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown cluster(s): {request.name}")
        notice = request.notice_s
        if request.preempt and not notice >= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"notice_s must be >= 0, not {notice}")
        if request.preempt and not request.dry_run:  # draining; its workers checkpoint what will not finish
            left = await asyncio.to_thread(self.d.queue.give_notice, request.name, request.notice_s)
            log.warning("cluster %s is preempted: %.1f s of notice", request.name, left)
        elif not request.dry_run:  # stop new assignments first, then move the queue away
            await asyncio.to_thread(self.d.queue.set_cluster_state, request.name, "draining")
            log.info("cluster %s is draining", request.name)
        return await self._run_rebalance(context, [request.name], request.dry_run)

    async def _exists(self, name: str) -> bool:
        """A registered cluster that was not removed."""
        if name not in await asyncio.to_thread(self.d.queue.cluster_names):
            return False
        return await asyncio.to_thread(self.d.queue.cluster_state, name) != "removed"

    async def AddCluster(self, request: pb.AddClusterRequest, context) -> pb.ClusterStatus:
        await self._authorize(context)
        problems = cluster_problems(request)
        if problems:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))
        exists = await self._exists(request.name)
        if exists and not request.update:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"cluster {request.name!r} exists; set update (fleetbatch gateway rebalance --add --update) to change it",
            )
        if request.update and not exists:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no cluster {request.name!r} to update")
        await asyncio.to_thread(
            self.d.queue.register_cluster,
            request.name,
            capacity_hint_tps=request.capacity_tokens_per_s or None,
            backend=request.backend or None,
            max_query_tokens=request.max_query_tokens or None,
            kv_budget_tokens=request.kv_budget_tokens or None,
            state="active",
        )
        log.info(
            "cluster %s %s (capacity hint %.1f tokens/s)",
            request.name,
            "updated" if exists else "added",
            request.capacity_tokens_per_s,
        )
        infos = await asyncio.to_thread(read_clusters, self.d.queue, [request.name])
        return cluster_proto(infos[0], cluster_views(infos)[0])

    async def RemoveCluster(self, request: pb.RemoveClusterRequest, context) -> pb.RebalanceResponse:
        await self._authorize(context)
        await self._check_name(request.name, context)
        if not await self._exists(request.name):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no cluster {request.name!r}")
        infos = await asyncio.to_thread(read_clusters, self.d.queue, [request.name])
        if infos[0].inflight > 0 and not request.force:  # a dry run answers as the real call would
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cluster {request.name} has {infos[0].inflight} running queries; drain it first or pass force",
            )
        # marked removed under the mover lease, once the plan shows every queued query can go elsewhere
        return await self._run_rebalance(context, [request.name], request.dry_run, remove=request.name)
