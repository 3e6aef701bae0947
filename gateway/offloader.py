"""Backoff offloading: idle clusters take not-yet-started work from the back of busy queues.

Every tick the offloader (1) requeues queries whose worker died (expired leases), (2)
moves the queued work of dead, draining or removed clusters to live ones, and (3) for each
idle or nearly idle cluster whose backoff allows it, asks :func:`gateway.offload.plan_offload`
for a paying move and carries it out with the atomic ``MOVE_TAIL`` Lua script. A cluster
that got nothing waits exponentially longer before asking again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from gateway.metrics import GatewayMetrics
from gateway.offload import Backoff, LinkCost, plan_offload
from gateway.policies import NoClusterError
from gateway.rebalance import plan_rebalance
from gateway.views import cluster_views, queued_loads
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


class Offloader:
    def __init__(
        self, queue: WorkQueue, config: OffloadConfig | None = None, metrics: GatewayMetrics | None = None
    ):
        self.queue = queue
        self.config = config or OffloadConfig()
        self.metrics = metrics
        self.backoffs: dict[str, Backoff] = {}
        self.moved_total = 0

    def _backoff(self, name: str) -> Backoff:
        if name not in self.backoffs:
            c = self.config
            self.backoffs[name] = Backoff(base_s=c.backoff_base_s, max_s=c.backoff_max_s)
        return self.backoffs[name]

    def _move(self, src: str, dst: str, count: int, why: str) -> int:
        moved, tokens = self.queue.move_tail(src, dst, count)
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
            if self._move(move.src, move.dst, move.count, "offload") > 0:
                backoff.succeeded()
                n_moved += move.count
            else:
                backoff.failed()
        return n_moved

    def _evacuate(self, infos) -> int:
        """Move queued work off clusters that cannot run it (dead, draining, removed)."""
        views = cluster_views(infos)
        stuck = [v.name for v, i in zip(views, infos, strict=True) if not v.accepting and i.queue_length > 0]
        if not stuck or not any(v.usable for v in views):
            return 0
        # bounded reads: only the stuck queues' tails, a chunk per tick (the rest moves next tick)
        queued = {name: queued_loads(self.queue, name, self.config.evacuate_chunk) for name in stuck}
        try:
            moves = plan_rebalance(views, queued, drain=stuck, links=self.config.links)
        except NoClusterError as e:
            log.warning("cannot evacuate %s: %s", ", ".join(stuck), e)
            return 0
        return sum(self._move(m.src, m.dst, m.count, "evacuate") for m in moves if m.src in stuck)
