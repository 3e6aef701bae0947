"""Typed API over the Redis schema: batches, per-cluster queues, leases, results, heartbeats.

Delivery is at-least-once with write-once results: a worker *claims* queries (they move
from the cluster's queue into its in-flight set with a lease deadline), renews the lease
while it works, and *completes* each query once. A worker that dies stops renewing; its
leases expire and :meth:`WorkQueue.requeue_expired` puts those queries back in their place
in the queue. A second completion of the same query id is ignored, so a query that ran
twice still has exactly one result. The claim side lives in :mod:`workqueue.leases`:

* lease deadlines and their expiry are measured on the Redis server's clock, not the
  clients' (a skewed client clock neither expires live leases nor keeps dead ones);
* a late completion, by a worker whose lease lapsed after its query was requeued, counts
  and takes the query back out of its queue and its tokens out of ``pending``;
* a query that used its ``max_attempts`` claims (default 3) fails, with its error recorded,
  at its next claim instead of running forever, and the rest of its batch goes on.

Batch creation (atomic, idempotent by id), results, lazy cancel and retention live in
:mod:`workqueue.batches`; moves between clusters happen under the mover lease
(:mod:`workqueue.mover`).

``clock`` (default :func:`time.time`) stamps what only ends up in records: creation,
enqueue, claim and completion times, heartbeats.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import redis

from workqueue import keys, move_scripts
from workqueue.batches import DEFAULT_RETENTION_S, BatchOps
from workqueue.intake_ops import IntakeOps
from workqueue.leases import DEFAULT_MAX_ATTEMPTS, LeaseOps
from workqueue.mover import MoverLease
from workqueue.ordering import QueueOrder
from workqueue.records import (
    ClusterInfo,
    Observation,
    QueryResult,
    QueryState,
    as_float,
    as_int,
    as_opt_int,
)
from workqueue.script_call import Command, execute
from workqueue.ticks import TickOps
from workqueue.wake import WakeListener, announce

__all__ = ["MOVE_WINDOW_SLACK", "WorkQueue"]

#: entries beyond a move's own ids that :meth:`WorkQueue.move_ids` looks at from the back of the
#: source queue: room for queries appended, and ids a plan skipped, between the plan and the move
MOVE_WINDOW_SLACK = 20_000


class WorkQueue(LeaseOps, BatchOps, IntakeOps, TickOps):
    """All queue operations on one Redis connection (thread-safe: redis-py pools connections).

    ``clock`` stamps records (lease deadlines use Redis time whatever it says) and is the clock batch
    deadlines are set and checked on; ``order`` is how batches are ordered in the queues
    (:mod:`workqueue.ordering`: earliest deadline first by default);
    ``max_attempts`` is how many claims a query gets: one popped after that many fails (None
    or 0: no limit); see :mod:`workqueue.leases`.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        clock: Callable[[], float] = time.time,
        max_attempts: int | None = DEFAULT_MAX_ATTEMPTS,
        retention_s: float = DEFAULT_RETENTION_S,
        order: QueueOrder = QueueOrder(),
    ):
        self.r = client
        self._init_leases(client, clock, max_attempts)
        self._init_batches(client, retention_s, order)
        self._init_intake_ops(client)
        self._init_ticks(client)
        self._move_tail = client.register_script(move_scripts.MOVE_TAIL)
        self._move_ids = client.register_script(move_scripts.MOVE_IDS)
        self._fail_ids = client.register_script(move_scripts.FAIL_IDS)

    @classmethod
    def from_url(cls, url: str, **kw) -> WorkQueue:
        return cls(redis.Redis.from_url(url, decode_responses=True), **kw)

    # ------------------------------------------------------------------ clusters

    def register_cluster(
        self,
        name: str,
        *,
        capacity_hint_tps: float | None = None,
        plan_tps: float | None = None,
        backend: str | None = None,
        max_query_tokens: int | None = None,
        kv_budget_tokens: int | None = None,
        state: str | None = None,
    ) -> None:
        pipe = self.r.pipeline(transaction=True)
        for op in self.register_commands(
            name,
            capacity_hint_tps=capacity_hint_tps,
            plan_tps=plan_tps,
            backend=backend,
            max_query_tokens=max_query_tokens,
            kv_budget_tokens=kv_budget_tokens,
            state=state,
        ):
            op.queue(pipe)
        pipe.execute()

    def register_commands(self, name: str, **fields: float | int | str | None) -> list[Command]:
        """The commands of :meth:`register_cluster` (fields left None are not written)."""
        if not name or ":" in name:
            raise ValueError(f"bad cluster name {name!r}: must be non-empty and contain no ':'")
        mapping = {k: v for k, v in fields.items() if v is not None}
        ops = [
            Command("sadd", keys.CLUSTERS, name),
            Command("hsetnx", keys.cluster_info(name), "state", "active"),
        ]
        if mapping:
            ops.append(Command("hset", keys.cluster_info(name), mapping=mapping))
        return ops

    def set_cluster_state(self, name: str, state: str) -> None:
        if state not in ("active", "draining", "removed"):
            raise ValueError(f"unknown cluster state {state!r}")
        self.r.hset(keys.cluster_info(name), "state", state)

    def cluster_state(self, name: str) -> str:
        """``active``, ``draining`` or ``removed`` (``active`` for a cluster never configured)."""
        return self.r.hget(keys.cluster_info(name), "state") or "active"

    def cluster_names(self) -> list[str]:
        return sorted(self.r.smembers(keys.CLUSTERS))

    def heartbeat(self, name: str, ttl_s: float, **fields: float | int | str) -> None:
        """Publish a worker's heartbeat; the cluster counts as alive until ``ttl_s`` passes without one."""
        pipe = self.r.pipeline(transaction=True)
        for op in self.heartbeat_commands(name, ttl_s, **fields):
            op.queue(pipe)
        pipe.execute()

    def heartbeat_commands(self, name: str, ttl_s: float, **fields: float | int | str) -> list[Command]:
        """The commands of :meth:`heartbeat`."""
        now = self.clock()
        return [
            Command("sadd", keys.CLUSTERS, name),
            Command("hsetnx", keys.cluster_info(name), "state", "active"),
            Command("hset", keys.cluster_info(name), "last_seen", now),
            Command("hset", keys.heartbeat(name), mapping={"ts": now, **fields}),
            Command("pexpire", keys.heartbeat(name), max(1, int(ttl_s * 1000))),
        ]

    def clusters(self, names: Iterable[str] | None = None) -> list[ClusterInfo]:
        names = list(names) if names is not None else self.cluster_names()
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(keys.cluster_info(n))
            pipe.hgetall(keys.heartbeat(n))
            pipe.zcard(keys.queue(n))
            pipe.zcard(keys.inflight(n))
            pipe.get(keys.pending(n))
            pipe.hgetall(keys.cluster_stats(n))
        raw = pipe.execute()
        out = []
        for i, n in enumerate(names):
            info, hb, qlen, infl, pend, stats = raw[i * 6 : i * 6 + 6]
            out.append(
                ClusterInfo(
                    name=n,
                    state=info.get("state", "active"),
                    backend=hb.get("backend") or info.get("backend", ""),
                    capacity_hint_tps=as_float(info.get("capacity_hint_tps") or hb.get("capacity_hint_tps")),
                    plan_tps=as_float(info.get("plan_tps") or hb.get("plan_tps")),
                    max_query_tokens=as_int(info.get("max_query_tokens") or hb.get("max_query_tokens")),
                    kv_budget_tokens=as_int(info.get("kv_budget_tokens") or hb.get("kv_total_tokens")),
                    alive=bool(hb),
                    last_heartbeat=as_float(hb.get("ts") or info.get("last_seen")),
                    measured_tps=as_float(hb.get("tokens_per_s")),
                    running=as_int(hb.get("running")),
                    waiting=as_int(hb.get("waiting")),
                    kv_used_tokens=as_int(hb.get("kv_used_tokens")),
                    kv_total_tokens=as_int(hb.get("kv_total_tokens")),
                    kv_step_tokens=as_int(hb.get("kv_step_tokens")),
                    kv_token_seconds=as_float(hb.get("kv_token_seconds")),
                    device_steps=as_int(hb.get("device_steps")),
                    device_overrun_steps=as_int(hb.get("device_overrun_steps")),
                    device_busy_s=as_float(hb.get("device_busy_s"), None),
                    steps=as_opt_int(hb.get("steps")),
                    redis_round_trips=as_opt_int(hb.get("redis_round_trips")),
                    running_remaining_tokens=as_float(hb.get("running_remaining_tokens")),
                    queue_length=int(qlen),
                    inflight=int(infl),
                    pending_tokens=max(0.0, as_float(pend)),
                    assigned_predicted_tokens=as_float(stats.get("assigned_predicted_tokens")),
                    finished_predicted_tokens=as_float(stats.get("finished_predicted_tokens")),
                    finished_actual_tokens=as_int(stats.get("finished_actual_tokens")),
                    finished_total_tokens=as_int(stats.get("finished_total_tokens")),
                    finished_queries=as_int(stats.get("finished_queries")),
                )
            )
        return out

    # ------------------------------------------------------------------ workers (claims: LeaseOps)

    def record_observed(self, rows: Sequence[Observation | Mapping], cap: int = 1_000_000) -> None:
        """Append observed (prompt, length) records for predictor retraining; keeps the newest ``cap``.

        Each row is an :class:`Observation` (or a mapping, written as it is)."""
        if rows:
            execute(self.r, self.observed_commands(rows, cap))

    def observed_commands(self, rows: Sequence[Observation | Mapping], cap: int = 1_000_000) -> list[Command]:
        """The commands of :meth:`record_observed` (``rows`` not empty)."""
        return [
            Command(
                "rpush",
                keys.OBSERVED,
                *[r.to_json() if isinstance(r, Observation) else json.dumps(dict(r)) for r in rows],
            ),
            Command("ltrim", keys.OBSERVED, -cap, -1),
        ]

    # ------------------------------------------------------------------ moving work

    def mover_lease(self, owner: str, ttl_s: float = 30.0, wait_s: float = 0.0) -> MoverLease:
        """The lease every mover (offloader, rebalance, any gateway replica) holds while it plans and
        moves: ``with queue.mover_lease("offloader") as held: ...`` (see :mod:`workqueue.mover`)."""
        return MoverLease(self.r, owner, ttl_s, wait_s)

    def move_tail(self, src: str, dst: str, n: int) -> tuple[int, float]:
        """Atomically move up to ``n`` not-yet-started queries from the back of ``src``'s queue to ``dst``'s."""
        if src == dst or n <= 0:
            return 0, 0.0
        moved, tokens = self._move_tail(
            keys=[keys.queue(src), keys.queue(dst), keys.pending(src), keys.pending(dst)], args=[src, dst, n]
        )
        if int(moved):
            announce(self.r, [dst])
        return int(moved), float(tokens)

    def move_ids(
        self, src: str, dst: str, gids: Sequence[str], window: int | None = None
    ) -> tuple[int, float]:
        """Atomically move exactly those of ``gids`` still queued on ``src`` to the back of ``dst``'s
        queue, in their order on ``src``; returns (moved, predicted tokens moved).

        Movers plan from a read of a queue's tail (:meth:`tail`) and move later: queries may
        have been claimed or appended meanwhile, and only the planned ones move. The script
        looks for them from the back of ``src``'s queue and stops once all are found or
        ``window`` entries were seen (default: ``len(gids)`` plus :data:`MOVE_WINDOW_SLACK`);
        planned ids further from the back stay for a later round."""
        gids = list(gids)
        if src == dst or not gids:
            return 0, 0.0
        window = len(gids) + MOVE_WINDOW_SLACK if window is None else window
        moved, tokens = self._move_ids(
            keys=[keys.queue(src), keys.queue(dst), keys.pending(src), keys.pending(dst)],
            args=[src, dst, max(1, int(window)), *gids],
        )
        if int(moved):
            announce(self.r, [dst])
        return int(moved), float(tokens)

    def fail_queued(self, cluster: str, results: Mapping[str, QueryResult], window: int | None = None) -> int:
        """Fail those of the queries ``results`` names (gid -> its failed result) still queued on
        ``cluster``: each leaves the queue and the ``pending`` counter and gets its result once, as
        :meth:`complete` writes it. They are looked for as :meth:`move_ids` looks for its ids (from
        the back, ``window`` entries). Returns how many were failed."""
        bad = [g for g, r in results.items() if r.outcome.state != QueryState.FAILED]
        if bad:
            raise ValueError(f"fail_queued takes failed results only: {', '.join(bad[:5])}")
        if not results:
            return 0
        window = len(results) + MOVE_WINDOW_SLACK if window is None else window
        args: list[str | int | float] = [cluster, max(1, int(window)), self.clock()]
        for g, r in results.items():
            args += [g, r.to_json()]
        return int(self._fail_ids(keys=[keys.queue(cluster), keys.pending(cluster)], args=args))

    def wake_listener(self, cluster: str) -> WakeListener:
        """A subscription that ends an idle worker's wait when queries land in ``cluster``'s queue."""
        return WakeListener(self.r, cluster)

    def tail(self, cluster: str, n: int, skip: int = 0) -> list[tuple[str, float]]:
        """The last ``n`` queued query ids of a cluster before its last ``skip`` (back of the queue
        last) with their predicted tokens."""
        gids = self.r.zrange(keys.queue(cluster), -(skip + n), -(skip + 1)) if n > 0 else []
        if not gids:
            return []
        pipe = self.r.pipeline(transaction=False)
        for g in gids:
            pipe.hget(keys.query(g), "tokens")
        return [(g, as_float(t)) for g, t in zip(gids, pipe.execute(), strict=True)]

    def queued_ids(self, cluster: str) -> list[str]:
        return self.r.zrange(keys.queue(cluster), 0, -1)

    def inflight_ids(self, cluster: str) -> list[str]:
        return self.r.zrange(keys.inflight(cluster), 0, -1)
