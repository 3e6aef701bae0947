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

**Composition.** :class:`WorkQueue` holds one part per job, each a class that gets what it
needs explicitly: the shared :class:`~workqueue.core.QueueCore` (client, clock, order,
settings) and, where it uses another part, that part through a ``Protocol`` its module
declares. The queue forwards each of its methods to one part (:func:`_via`: same name,
signature and docstring), so callers see one API:

========================  ===========================================  =============================
attribute                 part                                         what
========================  ===========================================  =============================
``cluster_ops``           :class:`workqueue.clusters.Clusters`         registration, state, heartbeats
``lease_ops``             :class:`workqueue.leases.Leases`             claims, leases, results
``batch_ops``             :class:`workqueue.batches.Batches`           creation, status, cancel, expiry
``intake_ops``            :class:`workqueue.intake_ops.Intake`         background intake
``move_ops``              :class:`workqueue.moves.Moves`               queue reads, moves
``tick_ops``              :class:`workqueue.ticks.Ticks`               many clusters per round trip
========================  ===========================================  =============================

Moves between clusters happen under the mover lease (:mod:`workqueue.mover`). ``clock``
(default :func:`time.time`) stamps what only ends up in records: creation, enqueue, claim and
completion times, heartbeats.
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import redis

from workqueue.batches import Batches
from workqueue.clusters import Clusters
from workqueue.core import DEFAULT_MAX_ATTEMPTS, DEFAULT_RETENTION_S, QueueCore
from workqueue.embedded import connect
from workqueue.intake_ops import Intake
from workqueue.leases import Leases
from workqueue.moves import MOVE_WINDOW_SLACK, Moves
from workqueue.ordering import QueueOrder
from workqueue.ticks import Ticks

__all__ = ["MOVE_WINDOW_SLACK", "WorkQueue"]

P = ParamSpec("P")
R = TypeVar("R")


def _via(part: str, method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[WorkQueue, P], R]:
    """``method`` of the queue's part ``part`` as a method of the queue: same name, signature and
    docstring; each call looks the part's method up, then calls it."""
    look_up = operator.attrgetter(f"{part}.{method.__name__}")

    @functools.wraps(method)
    def forward(self: WorkQueue, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return look_up(self)(*args, **kwargs)

    forward.__qualname__ = f"WorkQueue.{method.__name__}"
    return forward


class WorkQueue:
    """All queue operations on one Redis connection (thread-safe: redis-py pools connections).

    ``clock`` stamps records (lease deadlines use Redis time whatever it says) and is the clock batch
    deadlines are set and checked on; ``order`` is how batches are ordered in the queues
    (:mod:`workqueue.ordering`: earliest deadline first by default);
    ``max_attempts`` is how many claims a query gets: one popped after that many fails (None
    or 0: no limit); see :mod:`workqueue.leases`. ``retention_s``: how long a finished batch
    is kept (0: forever); see :mod:`workqueue.batches`.
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
        core = QueueCore.create(
            client, clock=clock, max_attempts=max_attempts, retention_s=retention_s, order=order
        )
        self.core = core
        self.cluster_ops = Clusters(core)
        self.lease_ops = Leases(core)
        self.batch_ops = Batches(core, self.cluster_ops)
        self.intake_ops = Intake(core, self.batch_ops)
        self.move_ops = Moves(core)
        self.tick_ops = Ticks(core, self.batch_ops)

    @classmethod
    def from_url(cls, url: str, **kw: Any) -> WorkQueue:
        """A queue on a client :func:`workqueue.embedded.connect` makes (its timeouts, TLS, clear errors)."""
        return cls(connect(url), **kw)

    # ------------------------------------------------------------------ the shared settings (QueueCore)

    @property
    def r(self) -> redis.Redis:
        """The Redis client every part uses."""
        return self.core.r

    @property
    def clock(self) -> Callable[[], float]:
        """The clock that stamps records and on which batch deadlines are set and checked."""
        return self.core.clock

    @property
    def order(self) -> QueueOrder:
        return self.core.order

    @property
    def max_attempts(self) -> int:
        """Claims a query gets (0: no limit)."""
        return self.core.max_attempts

    @property
    def retention_s(self) -> int:
        """Seconds a finished batch is kept (0: forever)."""
        return self.core.retention_s

    # ------------------------------------------------------------------ clusters (Clusters)

    register_cluster = _via("cluster_ops", Clusters.register_cluster)
    register_commands = _via("cluster_ops", Clusters.register_commands)
    set_cluster_state = _via("cluster_ops", Clusters.set_cluster_state)
    cluster_state = _via("cluster_ops", Clusters.cluster_state)
    state_call = _via("cluster_ops", Clusters.state_call)
    give_notice = _via("cluster_ops", Clusters.give_notice)
    cluster_names = _via("cluster_ops", Clusters.cluster_names)
    heartbeat = _via("cluster_ops", Clusters.heartbeat)
    heartbeat_commands = _via("cluster_ops", Clusters.heartbeat_commands)
    clusters = _via("cluster_ops", Clusters.clusters)
    record_observed = _via("cluster_ops", Clusters.record_observed)
    observed_commands = _via("cluster_ops", Clusters.observed_commands)
    wake_listener = _via("cluster_ops", Clusters.wake_listener)

    # ------------------------------------------------------------------ workers: claims, leases, results (Leases)

    claim = _via("lease_ops", Leases.claim)
    claim_call = _via("lease_ops", Leases.claim_call)
    parse_claim = _via("lease_ops", Leases.parse_claim)
    renew = _via("lease_ops", Leases.renew)
    renew_calls = _via("lease_ops", Leases.renew_calls)
    release = _via("lease_ops", Leases.release)
    checkpoint = _via("lease_ops", Leases.checkpoint)
    checkpoint_call = _via("lease_ops", Leases.checkpoint_call)
    requeue_expired = _via("lease_ops", Leases.requeue_expired)
    requeue_call = _via("lease_ops", Leases.requeue_call)
    complete = _via("lease_ops", Leases.complete)
    complete_call = _via("lease_ops", Leases.complete_call)

    # ------------------------------------------------------------------ batches (Batches)

    create_batch = _via("batch_ops", Batches.create_batch)
    batch = _via("batch_ops", Batches.batch)
    batch_ids = _via("batch_ops", Batches.batch_ids)
    prune_batches = _via("batch_ops", Batches.prune_batches)
    batch_statuses = _via("batch_ops", Batches.batch_statuses)
    cancel_batch = _via("batch_ops", Batches.cancel_batch)
    expire_due = _via("batch_ops", Batches.expire_due)
    expire_due_call = _via("batch_ops", Batches.expire_due_call)
    sweep_cancelled = _via("batch_ops", Batches.sweep_cancelled)
    results = _via("batch_ops", Batches.results)
    query_results = _via("batch_ops", Batches.query_results)
    result_count = _via("batch_ops", Batches.result_count)

    # ------------------------------------------------------------------ background intake (Intake)

    accept_batch = _via("intake_ops", Intake.accept_batch)
    new_stage = _via("intake_ops", Intake.new_stage)
    stage_rows = _via("intake_ops", Intake.stage_rows)
    drop_stage = _via("intake_ops", Intake.drop_stage)
    accept_staged = _via("intake_ops", Intake.accept_staged)
    intake_batches = _via("intake_ops", Intake.intake_batches)
    take_intake = _via("intake_ops", Intake.take_intake)
    drop_intake = _via("intake_ops", Intake.drop_intake)
    intake_state = _via("intake_ops", Intake.intake_state)
    enqueue_chunk = _via("intake_ops", Intake.enqueue_chunk)
    enqueue_parts = _via("intake_ops", Intake.enqueue_parts)
    forget_intake = _via("intake_ops", Intake.forget_intake)
    intake_page = _via("intake_ops", Intake.intake_page)
    intake_head = _via("intake_ops", Intake.intake_head)
    intake_wait = _via("intake_ops", Intake.intake_wait)
    intake_waited = _via("intake_ops", Intake.intake_waited)
    fail_lost_intake = _via("intake_ops", Intake.fail_lost_intake)

    # ------------------------------------------------------------------ the queues' contents, moving work (Moves)

    mover_lease = _via("move_ops", Moves.mover_lease)
    move_tail = _via("move_ops", Moves.move_tail)
    move_ids = _via("move_ops", Moves.move_ids)
    move_many = _via("move_ops", Moves.move_many)
    fail_queued = _via("move_ops", Moves.fail_queued)
    tail = _via("move_ops", Moves.tail)
    tails = _via("move_ops", Moves.tails)
    queued_ids = _via("move_ops", Moves.queued_ids)
    inflight_ids = _via("move_ops", Moves.inflight_ids)

    # ------------------------------------------------------------------ many clusters or batches per round trip (Ticks)

    requeue_all_expired = _via("tick_ops", Ticks.requeue_all_expired)
    requeue_and_expire = _via("tick_ops", Ticks.requeue_and_expire)
    batches = _via("tick_ops", Ticks.batches)
