"""Turn what Redis knows about clusters (:class:`workqueue.ClusterInfo`) into assigner views and protos."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.assign.capacity import effective_capacity
from gateway.assign.policies import ClusterView, QueryLoad, expected_finish_s
from protos import fleetbatch_pb2 as pb
from workqueue import ClusterInfo, WorkQueue


def cluster_views(infos: Sequence[ClusterInfo], alpha: float = 0.5) -> list[ClusterView]:
    """Assigner views. A cluster accepts work while it is active and alive (its heartbeat has not
    expired). A cluster never seen alive (its engine is still loading, or there is none) accepts
    work only while no cluster is alive, so a batch submitted at start-up waits durably in Redis;
    once some engine is alive, the offloader evacuates such queues to live clusters. A cluster
    whose heartbeats stopped does not accept work."""
    any_alive = any(i.alive and i.state == "active" for i in infos)
    views = []
    for i in infos:
        measured = i.measured_tps if (i.running > 0 or i.inflight > 0) else None
        views.append(
            ClusterView(
                name=i.name,
                capacity_tps=effective_capacity(
                    i.plan_tps or None, measured, i.capacity_hint_tps or None, alpha
                ),
                pending_tokens=max(0.0, i.pending_tokens + i.running_remaining_tokens),
                queue_length=i.queue_length,
                max_query_tokens=i.max_query_tokens or None,
                kv_budget_tokens=i.kv_budget_tokens or None,
                accepting=i.state == "active" and (i.alive or (i.last_heartbeat == 0 and not any_alive)),
            )
        )
    return views


def cluster_proto(info: ClusterInfo, view: ClusterView) -> pb.ClusterStatus:
    return pb.ClusterStatus(
        name=info.name,
        alive=info.alive,
        state=info.state,
        capacity_tokens_per_s=view.capacity_tps,
        plan_tokens_per_s=info.plan_tps,
        measured_tokens_per_s=info.measured_tps,
        queue_length=info.queue_length,
        running=info.running,
        waiting=info.waiting,
        kv_used_tokens=info.kv_used_tokens,
        kv_free_tokens=info.kv_free_tokens,
        pending_predicted_tokens=view.pending_tokens,
        expected_finish_s=expected_finish_s(view),
        last_heartbeat=info.last_heartbeat,
        backend=info.backend,
        inflight=info.inflight,
        assigned_predicted_tokens=info.assigned_predicted_tokens,
        finished_predicted_tokens=info.finished_predicted_tokens,
        finished_actual_tokens=info.finished_actual_tokens,
        finished_queries=info.finished_queries,
    )


def view_proto(view: ClusterView) -> pb.ClusterStatus:
    """A predicted state (after planned moves) as a status message."""
    return pb.ClusterStatus(
        name=view.name,
        state="active" if view.accepting else "draining",
        capacity_tokens_per_s=view.capacity_tps,
        queue_length=view.queue_length,
        pending_predicted_tokens=view.pending_tokens,
        expected_finish_s=expected_finish_s(view),
    )


MAX_TAIL_READ = 20_000  # most queued ids read from one queue at a time (queues may hold millions)


def queued_loads(
    queue: WorkQueue, cluster: str, limit: int = MAX_TAIL_READ, skip: int = 0
) -> list[QueryLoad]:
    """The last ``limit`` queued queries of a cluster (before its last ``skip``) as assigner loads
    (front first), read from Redis. Reads are bounded: a plan made from them moves at most
    ``limit`` queries per queue, and the rest move on a later round.

    A load's ``total_tokens`` is the row's full size (prompt + predicted response, without the
    prefix discount its ``tokens`` charge has: :func:`workqueue.moves.full_size`): what every fit
    check of a move needs (``max_query_tokens``, the KV budget) and what the row is charged on the
    cluster it moves to."""
    return [QueryLoad(g, 0, t) for g, t in queue.tail(cluster, min(limit, MAX_TAIL_READ), skip)]


def queued_tails(queue: WorkQueue, reads: dict[str, tuple[int, int]]) -> dict[str, list[QueryLoad]]:
    """:func:`queued_loads` of many clusters (``cluster -> (limit, skip)``) in two round trips, at their
    full sizes."""
    tails = queue.tails({c: (min(n, MAX_TAIL_READ), skip) for c, (n, skip) in reads.items()})
    return {c: [QueryLoad(g, 0, t) for g, t in tail] for c, tail in tails.items()}
