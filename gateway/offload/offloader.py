"""Backoff offloading: idle clusters take not-yet-started work from the back of busy queues.

Every tick the offloader (1) requeues queries whose worker died (expired leases), (2)
moves the queued work of dead, draining or removed clusters to live ones, and (3) for each
idle or nearly idle cluster whose backoff allows it, asks :func:`gateway.offload.moves.plan_offload`
for a paying move (under the cost policy, one its rule allows, as far as its fill goes:
:mod:`gateway.assign.cost_moves`). Steps (1) and (2) always run; (3) only with ``balance`` (``fleetbatch gateway serve
--no-offload`` turns it off). A cluster that got nothing waits exponentially longer before
asking again.

Every move carries the ids it planned (the atomic ``MOVE_IDS`` Lua script): queries claimed
or appended between the plan and the move stay where they are. A queued query of a dead or
draining cluster that fits on no accepting cluster stays in its queue (logged when the set
of such queries changes); the rest of the queue moves past it: each tick reads a chunk of
the queue from the back, past the queries already known to stay there (up to
:data:`MAX_EVACUATE_DEPTH` deep, then again from the back), so any number of them never
blocks the rest. Every fit check (a cluster's ``max_query_tokens``, its KV budget) is of a query's
full size, prompt + predicted response without the prefix discount its cluster charges it
(:func:`gateway.assign.views.queued_tails`), and a moved query is charged that size where it
lands. A removed cluster runs nothing: its queued query that fits on no active
cluster at all (alive or not) can never run, and is failed alone, once, with an error that
names the cluster and why (it got there past ``RemoveCluster``'s check: deeper in the queue
than the check reads, or assigned just before the cluster was marked).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.assign.calibrated import LengthCalibrator
from gateway.assign.cost import SPOT_MARGIN, holds_work
from gateway.assign.cost_moves import FillRule, evacuation_rules, fill_rule
from gateway.assign.loads import work_units
from gateway.assign.policies import ClusterView, NoClusterError, QueryLoad
from gateway.assign.views import cluster_views, queued_tails
from gateway.offload.moves import Backoff, LinkCost, Move, plan_offload
from gateway.offload.rebalance import Allowed, RebalancePlan, Split, plan_moves
from gateway.status.eta import ClusterLoad, EtaBoard
from gateway.status.metrics import GatewayMetrics
from workqueue import BatchInfo, ClusterInfo, QueryResult, WorkQueue, keys
from workqueue.queue import MOVE_WINDOW_SLACK

log = logging.getLogger(__name__)

MAX_EVACUATE_DEPTH = 200_000  # queued ids known to stay that evacuation reads past, before it starts again


@dataclass
class OffloadConfig:
    lookahead_s: float = 2.0  # "nearly idle": held work it can finish within this many seconds
    tail_len: int = 256  # queries looked at from the back of each donor queue
    evacuate_chunk: int = 2000  # most queries moved off one dead/draining queue per tick
    mover_ttl_s: float = 30.0  # the mover lease lapses this long after a holder died mid-tick
    links: LinkCost = field(default_factory=LinkCost)
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    balance: bool = (
        True  # step (3): moves between live clusters (off: `fleetbatch gateway serve --no-offload`)
    )
    #: the cost policy's prices (dollars per hour by cluster): step (2) drains by its split and step (3) makes only
    #: the moves its rule allows, as far as its fill goes (gateway.assign.cost_moves: evacuation_rules, move_allowed,
    #: fill_rule); None: every paying move, to equal finish times
    prices: Mapping[str, float] | None = None
    #: the cost policy's spot clusters: an evacuated queue's share of them leaves room for a preemption
    spot: frozenset[str] = frozenset()
    #: the cost policy's spot margin (its ``spot_margin``)
    spot_margin: float = SPOT_MARGIN


class Offloader:
    def __init__(
        self,
        queue: WorkQueue,
        config: OffloadConfig | None = None,
        metrics: GatewayMetrics | None = None,
        eta: EtaBoard | None = None,
        calibrator: LengthCalibrator | None = None,
    ):
        self.queue = queue
        self.config = config or OffloadConfig()
        self.metrics = metrics
        self.eta = eta
        self.calibrator = calibrator  # its current calibration is a metric (gateway.assign.calibrated)
        self.backoffs: dict[str, Backoff] = {}
        self.moved_total = 0
        self.kept: dict[str, list[str]] = {}  # per stuck cluster: queued ids at its back that fit nowhere now
        self.skip: dict[str, int] = {}  # per stuck cluster: entries at the back of its queue known to stay
        #: seconds to each unfinished batch's deadline (those with one)
        self.deadlines_in_s: dict[str, float] = {}

    def _backoff(self, name: str) -> Backoff:
        if name not in self.backoffs:
            c = self.config
            self.backoffs[name] = Backoff(base_s=c.backoff_base_s, max_s=c.backoff_max_s)
        return self.backoffs[name]

    def _moves(self, moves: list[tuple[Move, int | None]], why: str) -> list[int]:
        """Carry out ``moves`` (each with its ``window``: how far from its source's back its ids
        are looked for; None: its ids plus the slack) in one round trip: exactly the planned ids
        still queued on each source. Returns each move's count moved."""
        if not moves:
            return []
        done = self.queue.move_many(
            [(m.src, m.dst, m.keys, len(m.keys) + MOVE_WINDOW_SLACK if w is None else w) for m, w in moves]
        )
        for (m, _), (moved, tokens) in zip(moves, done, strict=True):
            if moved:
                self.moved_total += moved
                if self.metrics is not None:
                    self.metrics.moves.labels(m.src, m.dst).inc(moved)
                log.info(
                    "%s: moved %d queries (%.0f predicted tokens) %s -> %s", why, moved, tokens, m.src, m.dst
                )
        return [moved for moved, _ in done]

    def tick(self) -> int:
        """One round; returns how many queries moved. Batches whose deadline passed expire here
        (:meth:`workqueue.WorkQueue.expire_due`), with the lapsed leases' requeue. Moves happen only under the mover lease,
        so offloaders of several gateway replicas and admin rebalance never plan from the same
        snapshot; a tick that finds the lease held requeues lapsed leases and moves nothing.

        Its round trips do not grow with the clusters: one script requeues every cluster's lapsed
        leases, one pipeline reads the clusters, one the donors' tails, one makes the moves."""
        q = self.queue
        start = q.requeue_and_expire()
        for name, n in start.requeued.items():
            if n:
                log.warning("requeued %d queries of %s whose worker stopped renewing", n, name)
        for batch_id in start.expired:
            log.warning("batch %s expired: its completion window ended; finished rows are kept", batch_id)
        infos = q.clusters(sorted(start.requeued))  # every registered cluster, as the script found them
        now = q.clock()
        self.deadlines_in_s = {b.batch_id: b.deadline - now for b in start.unfinished if b.deadline > 0}
        if self.metrics is not None and self.calibrator is not None:
            self.metrics.observe_calibration(self.calibrator.current())
        if self.eta is not None:
            try:
                self._estimate(start.unfinished, infos)
            except Exception:  # the ETA never stops lease recovery, evacuation or offloading
                log.exception("the ETA refresh failed; the tick goes on")
        with q.mover_lease("offloader", ttl_s=self.config.mover_ttl_s) as held:
            if not held:
                if self.metrics is not None:
                    self.metrics.observe_clusters(infos, cluster_views(infos))
                return 0
            return self._offload(infos)

    def _estimate(self, batches: list[BatchInfo], infos: list[ClusterInfo]) -> None:
        """Refresh every unfinished batch's ETA (:mod:`gateway.status.eta`) from what this tick read: the fleet's
        running totals and capacity, and each accepting cluster's (its lane: rows queued there wait for it)."""
        views = {v.name: v for v in cluster_views(infos)}
        live = [i for i in infos if views[i.name].accepting]
        if (
            not self.eta.balanced
        ):  # the cost policy: the clusters that hold work run it, and nothing evens them out
            live = [i for i in live if holds_work(i)] or live
        capacity = sum(views[i.name].capacity_tps for i in live)
        now = self.queue.clock()
        lanes = {
            i.name: ClusterLoad(
                i.finished_total_tokens, i.finished_actual_tokens, views[i.name].capacity_tps, i.running
            )
            for i in live
        }
        self.eta.cost.update(now, infos, batches)  # the billing model, metered (gateway.status.cost)
        etas = self.eta.update(
            now,
            batches,
            sum(i.finished_total_tokens for i in infos),
            sum(i.finished_predicted_tokens for i in infos),
            capacity,
            sum(i.finished_actual_tokens for i in infos),  # their completion tokens: the prompt share
            lanes,
        )
        if self.metrics is not None:
            self.metrics.observe_etas(etas, now)
            self.metrics.observe_cost(self.eta.cost, [i.name for i in infos])

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
        asking = [v for v in views if self._asks(v)]
        # one read of every donor's tail, deep enough that each asking cluster plans from the last
        # tail_len queries left after the moves planned before it (as if it read the tail afresh)
        n = self.config.tail_len
        tails = queued_tails(q, {b.name: (n * len(asking), 0) for b in busy}) if asking and busy else {}
        planned: list[tuple[Move, int | None]] = []
        allowed, fill = self._allowed(), self._fill()  # the cost policy's rules for this tick (None: not it)
        for v in asking:
            backoff = self._backoff(v.name)
            others = {b: t[-n:] if n > 0 else [] for b, t in tails.items() if b != v.name}
            move = plan_offload(
                v,
                [by_name[b] for b in others],
                others,
                self.config.links,
                idle_threshold_tokens=v.capacity_tps * self.config.lookahead_s,
                allowed=allowed,
                fill=fill,
            )
            if move is None:
                backoff.failed()
                log.debug("%s idle, nothing worth taking; next ask in %.1f s", v.name, backoff.delay_s)
                continue
            planned.append((move, None))
            taken = set(move.keys)
            tails[move.src] = [t for t in tails[move.src] if t.key not in taken]
        for (move, _), moved in zip(planned, self._moves(planned, "offload"), strict=True):
            if moved > 0:
                self._backoff(move.dst).succeeded()
                n_moved += moved
            else:
                self._backoff(move.dst).failed()
        return n_moved

    def _work_per_token(self) -> float:
        """Work units a queued token is worth, at the prompt share of the fleet's answered rows (1: no ETA)."""
        return work_units(self.eta.prompt_share) if self.eta is not None else 1.0

    def _allowed(self) -> Allowed | None:
        """The cost policy's rule for this tick's moves (None: not the cost policy)."""
        rules = self._cost_rules()
        return rules[1] if rules is not None else None

    def _fill(self) -> FillRule | None:
        """The cost policy's fill for this tick's moves (:func:`gateway.assign.cost_moves.fill_rule`; None: not the
        cost policy)."""
        terms = self._cost_terms()
        return fill_rule(**terms) if terms is not None else None

    def _cost_rules(self) -> tuple[Split, Allowed] | None:
        """The cost policy's drain split and move rule (:func:`gateway.assign.cost_moves.evacuation_rules`) for this tick
        (None: not the cost policy)."""
        terms = self._cost_terms()
        return evacuation_rules(**terms) if terms is not None else None

    def _cost_terms(self) -> dict[str, Any] | None:
        """What the cost policy's rules are made of this tick: prices, spot clusters and margin, deadlines, the
        work a queued token is worth (None: not the cost policy)."""
        if self.config.prices is None:
            return None
        return {
            "prices": self.config.prices,
            "spot": self.config.spot,
            "deadlines_in_s": self.deadlines_in_s,
            "spot_margin": self.config.spot_margin,
            "pending_work_per_token": self._work_per_token(),
        }

    def _asks(self, v: ClusterView) -> bool:
        """Whether ``v`` asks for work now: usable, nothing queued, what it holds done within
        ``lookahead_s``, and its backoff over."""
        if not v.usable or v.queue_length > 0 or v.pending_tokens > v.capacity_tps * self.config.lookahead_s:
            return False
        return self._backoff(v.name).ready()

    def _evacuate(self, infos: list[ClusterInfo]) -> int:
        """Move queued work off clusters that cannot run it (dead, draining, removed); queries that
        fit on no accepting cluster stay (see :meth:`_report_kept`), except on a removed cluster
        when they fit on no active one (:meth:`_fail_stranded`)."""
        views = cluster_views(infos)
        stuck = [v.name for v, i in zip(views, infos, strict=True) if not v.accepting and i.queue_length > 0]
        self.skip = {name: n for name, n in self.skip.items() if name in stuck}
        if not stuck or not any(v.usable for v in views):
            return 0
        # bounded reads: a chunk of each stuck queue's tail, past the entries known to stay there
        chunk = self.config.evacuate_chunk
        skip = {name: self.skip.get(name, 0) for name in stuck}
        queued = queued_tails(self.queue, {name: (chunk, skip[name]) for name in stuck})
        try:
            # the drain's moves only (balancing is step 3's); under the cost policy the drain follows its split
            split, allowed = self._cost_rules() or (None, None)
            plan = plan_moves(
                views,
                queued,
                drain=stuck,
                links=self.config.links,
                split=split,
                allowed=allowed,
                balance=False,
            )
        except NoClusterError as e:
            log.warning("cannot evacuate %s: %s", ", ".join(stuck), e)
            return 0
        removed = {i.name for i in infos if i.state == "removed"}
        active = [v for v, i in zip(views, infos, strict=True) if i.state == "active"]
        kept = {
            name: self._fail_stranded(name, plan.kept.get(name, []), active, skip[name] + chunk)
            if name in removed
            else plan.kept.get(name, [])
            for name in stuck
        }
        self._report_kept({name: kept[name] for name in stuck if skip[name] == 0}, set(stuck))
        moves = [(m, skip[m.src] + chunk + MOVE_WINDOW_SLACK) for m in plan.moves if m.src in stuck]
        moved = sum(self._moves(moves, "evacuate"))
        # the next tick reads past what stays; from the back again once past the front, or too deep
        for name in stuck:
            depth = skip[name] + len(kept[name])
            self.skip[name] = depth if queued[name] and depth <= MAX_EVACUATE_DEPTH else 0
        return moved

    def _fail_stranded(
        self, name: str, kept: list[QueryLoad], active: list[ClusterView], window: int
    ) -> list[QueryLoad]:
        """Fail the queries of removed cluster ``name`` that fit on no active cluster (alive or
        not): nothing can ever run them. Returns the rest, which wait for a cluster they fit on."""
        doomed = [q for q in kept if not any(v.fits(q) for v in active if v.name != name)]
        if not doomed:
            return kept
        why = (
            f"cluster {name} was removed while this query was queued on it, and it fits on no other "
            "active cluster (its prompt + predicted response exceeds their max_query_tokens / KV budget)"
        )
        results = {}
        for q in doomed:
            bid, qid = keys.split_gid(q.key)
            results[q.key] = QueryResult(bid, qid, cluster=name, finish_reason="error", error=why)
        n = self.queue.fail_queued(name, results, window + MOVE_WINDOW_SLACK)
        log.error(
            "failed %d queued quer%s of removed cluster %s that fit on no other active cluster: %s",
            n,
            "y" if n == 1 else "ies",
            name,
            ", ".join(q.key for q in doomed[:10]) + (", ..." if len(doomed) > 10 else ""),
        )
        gone = {q.key for q in doomed}
        return [q for q in kept if q.key not in gone]

    def _report_kept(self, kept: dict[str, list[QueryLoad]], stuck: set[str]) -> None:
        """Log the queries that stay at the back of a stuck cluster when they change (not on every
        tick). ``kept``: the clusters whose queue was read from its back this tick."""
        now = {name: [q.key for q in loads] for name, loads in kept.items() if loads}
        changed = {name: kept[name] for name in now if now[name] != self.kept.get(name)}
        for line in RebalancePlan([], changed).kept_lines():
            log.warning("cannot evacuate: %s; they wait for it (or for a cluster they fit on)", line)
        self.kept = {n: ids for n, ids in self.kept.items() if n in stuck and n not in kept} | now
