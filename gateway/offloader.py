"""Backoff offloading: idle clusters take not-yet-started work from the back of busy queues.

Every tick the offloader (1) requeues queries whose worker died (expired leases), (2)
moves the queued work of dead, draining or removed clusters to live ones, and (3) for each
idle or nearly idle cluster whose backoff allows it, asks :func:`gateway.offload.plan_offload`
for a paying move. Steps (1) and (2) always run; (3) only with ``balance`` (``gateway serve
--no-offload`` turns it off). A cluster that got nothing waits exponentially longer before
asking again.

Every move carries the ids it planned (the atomic ``MOVE_IDS`` Lua script): queries claimed
or appended between the plan and the move stay where they are. A queued query of a dead or
draining cluster that fits on no accepting cluster stays in its queue (logged when the set
of such queries changes); the rest of the queue moves past it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from gateway.metrics import GatewayMetrics
from gateway.offload import Backoff, LinkCost, Move, plan_offload
from gateway.policies import NoClusterError
from gateway.rebalance import plan_moves
from gateway.views import MAX_TAIL_READ, cluster_views, queued_loads
from workqueue import WorkQueue

log = logging.getLogger(__name__)


@dataclass
class OffloadConfig:
    lookahead_s: float = 2.0  # "nearly idle": held work it can finish within this many seconds
    tail_len: int = 256  # queries looked at from the back of each donor queue
    evacuate_chunk: int = 2000  # most queries moved off one dead/draining queue per tick
    mover_ttl_s: float = 30.0  # the mover lease lapses this long after a holder died mid-tick
    links: LinkCost = field(default_factory=LinkCost)
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    balance: bool = True  # step (3): moves between live clusters (off: `gateway serve --no-offload`)


class Offloader:
    def __init__(
        self, queue: WorkQueue, config: OffloadConfig | None = None, metrics: GatewayMetrics | None = None
    ):
        self.queue = queue
        self.config = config or OffloadConfig()
        self.metrics = metrics
        self.backoffs: dict[str, Backoff] = {}
        self.moved_total = 0
        self.kept: dict[str, list[str]] = {}  # per stuck cluster: queued ids that fit on no accepting cluster

    def _backoff(self, name: str) -> Backoff:
        if name not in self.backoffs:
            c = self.config
            self.backoffs[name] = Backoff(base_s=c.backoff_base_s, max_s=c.backoff_max_s)
        return self.backoffs[name]

    def _move(self, move: Move, why: str) -> int:
        """Carry out ``move``: exactly its planned ids that are still queued on its source."""
        src, dst = move.src, move.dst
        moved, tokens = self.queue.move_ids(src, dst, move.keys)
        if moved:
            self.moved_total += moved
            if self.metrics is not None:
                self.metrics.moves.labels(src, dst).inc(moved)
            log.info("%s: moved %d queries (%.0f predicted tokens) %s -> %s", why, moved, tokens, src, dst)
        return moved

    def tick(self) -> int:
        """One round; returns how many queries moved. Moves happen only under the mover lease,
        so offloaders of several gateway replicas and admin rebalance never plan from the same
        snapshot; a tick that finds the lease held requeues lapsed leases and moves nothing."""
        q = self.queue
        infos = q.clusters()
        for i in infos:
            n = q.requeue_expired(i.name)
            if n:
                log.warning("requeued %d queries of %s whose worker stopped renewing", n, i.name)
        with q.mover_lease("offloader", ttl_s=self.config.mover_ttl_s) as held:
            if not held:
                if self.metrics is not None:
                    self.metrics.observe_clusters(infos, cluster_views(infos))
                return 0
            return self._offload(infos)

    def _offload(self, infos) -> int:
        q = self.queue
        if n_moved := self._evacuate(infos):
            infos = q.clusters()
        views = cluster_views(infos)
        if self.metrics is not None:
            self.metrics.observe_clusters(infos, views)
        if not self.config.balance:
            return n_moved
        by_name = {v.name: v for v in views}
        busy = [v for v in views if v.queue_length > 0]
        for v in views:
            if not v.usable or v.queue_length > 0:
                continue
            threshold = v.capacity_tps * self.config.lookahead_s
            if v.pending_tokens > threshold:
                continue
            backoff = self._backoff(v.name)
            if not backoff.ready():
                continue
            tails = {b.name: queued_loads(q, b.name, self.config.tail_len) for b in busy if b.name != v.name}
            move = plan_offload(
                v, [by_name[n] for n in tails], tails, self.config.links, idle_threshold_tokens=threshold
            )
            if move is None:
                backoff.failed()
                log.debug("%s idle, nothing worth taking; next ask in %.1f s", v.name, backoff.delay_s)
                continue
            if (moved := self._move(move, "offload")) > 0:
                backoff.succeeded()
                n_moved += moved
            else:
                backoff.failed()
        return n_moved

    def _evacuate(self, infos) -> int:
        """Move queued work off clusters that cannot run it (dead, draining, removed); queries that
        fit on no accepting cluster stay (see :meth:`_report_kept`)."""
        views = cluster_views(infos)
        stuck = [v.name for v, i in zip(views, infos, strict=True) if not v.accepting and i.queue_length > 0]
        if not stuck or not any(v.usable for v in views):
            return 0
        # bounded reads: only the stuck queues' tails, a chunk (past the queries known to stay) per tick
        chunk = self.config.evacuate_chunk
        queued = {
            name: queued_loads(self.queue, name, min(MAX_TAIL_READ, chunk + len(self.kept.get(name, ()))))
            for name in stuck
        }
        try:
            plan = plan_moves(views, queued, drain=stuck, links=self.config.links)
        except NoClusterError as e:
            log.warning("cannot evacuate %s: %s", ", ".join(stuck), e)
            return 0
        self._report_kept(
            {name: [q.key for q in plan.kept.get(name, [])] for name in stuck}, plan.kept_lines()
        )
        return sum(self._move(m, "evacuate") for m in plan.moves if m.src in stuck)

    def _report_kept(self, kept: dict[str, list[str]], lines: list[str]) -> None:
        """Log the queries that stay on a stuck cluster when they change (not on every tick)."""
        kept = {name: ids for name, ids in kept.items() if ids}
        if kept != self.kept:
            for line in lines:
                log.warning("cannot evacuate: %s; they wait for it (or for a cluster they fit on)", line)
        self.kept = kept
