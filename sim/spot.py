"""Spot clusters in the simulator: prices and the billing model, preemption notices, hard kills and queries resumed
from their partial output, on :class:`sim.core.Simulator`.

What runs for real: the ``cost`` policy given the batch's window (:func:`gateway.assign.cost.assign_batch`), a
drain's split (:func:`gateway.assign.cost_moves.evacuation_rules` under the cost policy, the water filling of
:func:`gateway.assign.policies.water_fill_targets` otherwise), the offloader's move rule and fill under the cost
policy (:func:`gateway.assign.cost_moves.move_allowed`, :func:`~gateway.assign.cost_moves.fill_rule`), and under it
the admin call of a notice's balance phase (:func:`gateway.offload.rebalance.plan_moves`).

What is modelled:

* **Billing**, as :class:`gateway.status.cost.CostMeter` meters it: at every offloader tick (0.5 s) each cluster
  that holds work (queued, held by its engine, or leased by a killed one) is billed at its price
  (:func:`gateway.assign.cost.dollars_per_second`) until the next tick; the last interval ends with the batch.
* **A notice** (:class:`Outage` ``preempt``) at ``t``: the cluster takes no more work and its queue is drained at
  the next tick (:meth:`SpotSimulator._drain`: the drain phase of :func:`gateway.offload.rebalance.plan_moves`,
  back of the queue first to the receiver with the largest deficit of the split; every simulated query fits
  everywhere, so there is no fit check); at ``t + notice_s`` its engine stops: each query it held goes back to
  its queue with every token it generated as its partial output (no attempt used), and is drained in turn.
  (The real worker gives back the queries it claimed ahead, and the running ones that will not finish within the
  notice, at once: here they wait for the engine's stop, generating on meanwhile.) Under the cost policy the notice
  is the admin call's (``gateway rebalance --preempt``): the queue is drained at once and the clusters up are
  balanced to the cost split (:meth:`SpotSimulator._notice_rebalance`).
* **A hard kill** (``kill``) at ``t``: the engine is gone at once; each query it held keeps its output up to its
  last snapshot (:mod:`engines.checkpoints` takes one every ``ceil(checkpoint_tokens / 2)`` tokens of a run; the
  rest is *recomputed*) and is back in the cluster's queue when its lease lapses (:attr:`Market.lease_s`),
  billed to the cluster until then. (The snapshot is written in the agent's next tick: not modelled.)
* **Back** at ``back_t``: a fresh engine (empty KV cache, :meth:`Simulator._make_engine`) takes work again.
* **A resumed query** starts with its partial output as its output (as ``Sequence.from_request`` resumes one), so
  it is prefilled with its prompt and those tokens and decodes only the rest of its length
  (:attr:`sim.engines.IterationEngine.resumed`).

Static engines have no partial outputs: a fleet with outages runs the iteration-level or pipelined ones.
:mod:`sim.spot_replay` replays a ``fleetbatch loadgen spot`` run with this; :func:`sim.spot_scale.scale_spot`
runs 100 clusters with a synthetic preemption process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from gateway.assign.cost import SPOT_MARGIN, assign_batch, dollars_per_second
from gateway.assign.cost_moves import FillRule, evacuation_rules, fill_rule, move_allowed
from gateway.assign.loads import ClusterView, QueryLoad, work_per_token
from gateway.assign.policies import water_fill_targets
from gateway.assign.registry import make_policy
from gateway.offload.rebalance import plan_moves
from sim.cluster import ClusterSpec, SimCluster
from sim.core import EVENT, TICK, SimConfig, Simulator
from sim.result import SimResult
from sim.workload import Workload

NOTICE, STOP, BACK, REQUEUE = 0, 1, 2, 3  # an outage's phases (the EVENT's version)
#: engine counters a restarted engine carries on (per cluster, over its processes)
CARRIED = ("generated_tokens", "num_steps", "kv_token_seconds", "kv_cached_token_seconds",
           "cumulative_kv_tokens", "prefill_tokens", "num_preemptions")  # fmt: skip
KV_CARRIED = ("hit_tokens", "lookup_tokens")  # the prefix cache's counters (not its blocks: a fresh engine)


@dataclass(frozen=True)
class Outage:
    """A cluster preempted with ``notice_s`` seconds of notice, or killed (``kind="kill"``), at ``t`` (the
    simulator's clock), and taking work again at ``back_t`` (never: ``inf``; not before its engine stopped)."""

    cluster: str
    t: float
    kind: str = "preempt"
    notice_s: float = 0.0
    back_t: float = math.inf

    def __post_init__(self) -> None:
        if self.kind not in ("preempt", "kill"):
            raise ValueError(f"an outage is a preempt or a kill, not {self.kind!r}")
        if not (math.isfinite(self.t) and self.t >= 0 and self.notice_s >= 0):
            raise ValueError(f"outage of {self.cluster!r}: t and notice_s must be finite and >= 0")


@dataclass(frozen=True)
class Market:
    """The fleet's prices (dollars per hour, by cluster; a cluster with none costs nothing), its spot clusters,
    the batch's completion window from its first arrival (None: no deadline), how often running queries are
    checkpointed (tokens) and how long a killed engine's leases take to lapse (s)."""

    prices: Mapping[str, float] = field(default_factory=dict)
    spot: frozenset[str] = frozenset()
    window_s: float | None = None
    checkpoint_tokens: int = 64
    lease_s: float = 15.0
    spot_margin: float = SPOT_MARGIN  # the cost policy's (the gateway's --spot-margin)


class SpotSimulator(Simulator):
    """:class:`Simulator` with a :class:`Market` and :class:`Outage` events (see the module docstring)."""

    def __init__(
        self,
        specs: list[ClusterSpec],
        work: Workload,
        config: SimConfig | None = None,
        market: Market | None = None,
        outages: Sequence[Outage] = (),
    ) -> None:
        super().__init__(specs, work, config)
        self.market = m = market or Market()
        self.index = {c.name: i for i, c in enumerate(self.clusters)}
        unknown = sorted({o.cluster for o in outages} - set(self.index))
        if unknown:
            raise ValueError(f"outages of unknown clusters: {', '.join(unknown)}")
        if outages and any(c.spec.backend == "static" for c in self.clusters):
            raise ValueError(
                "static engines keep no partial outputs: outages need iteration or pipelined ones"
            )
        self.outages = list(outages)
        self.policy = make_policy(self.config.policy, m.prices, m.spot, m.spot_margin)
        self.resumed = [0] * len(work)  # each query's partial output (tokens)
        for c in self.clusters:
            c.engine.resumed = self.resumed
        # the workload's mix, for the drain's split and the move rule (one load of its sums: the same ratio)
        whole = QueryLoad("all", max(1, sum(work.prompt_tokens)), float(sum(work.predicted_tokens)))
        self.work_per_token = work_per_token([whole])
        self.dollars = {c.name: 0.0 for c in self.clusters}
        # (cluster, dollars a second) of each cluster holding work at the last tick
        self._billed: list[tuple[str, float]] = []
        self._last_bill: float | None = None
        # outage -> a killed engine's queries, until their leases lapse
        self._leased: dict[int, list[int]] = {}
        self._outages_on = [0] * len(self.clusters)  # outages under way, by cluster
        self._round_views: dict[str, ClusterView] = {}  # the cost policy's views of this offloader round
        self._round_window: float | None = None
        self._round_fill: FillRule = lambda donor, recipient: None  # the cost policy's fill of this round
        self.start = min(work.arrival_s, default=0.0)
        self.checkpointed = 0  # running queries a notice stopped with a partial output
        self.killed_running = 0  # running queries a kill stopped
        self.recomputed_tokens = 0  # tokens a kill lost (generated since a query's last checkpoint)

    # ---- the gateway's side -------------------------------------------------------------------
    def _ticks(self) -> bool:
        return True  # billing and drains run at every tick, offloading or not

    def _window_left(self) -> float | None:
        w = self.market.window_s
        return None if w is None else max(0.0, self.start + w - self.now)

    def _view(self, c: SimCluster) -> ClusterView:
        """``c`` as the gateway sees it: accepting unless down, its capacity in the gateway's unit (work units a
        second, :data:`gateway.assign.loads.PROMPT_WEIGHT`: what the cost policy's times are counted in). A plan's
        rate or a configured hint is in that unit already; one derived from the cost model
        (:meth:`sim.costs.LinearCost.tokens_per_s`) counts prompt and response tokens alike, so it is scaled by the
        workload's work per token."""
        v = c.view()
        derived = c.spec.capacity_tps is None and c.spec.backend != "pipelined"
        cap = v.capacity_tps * self.work_per_token if derived else v.capacity_tps
        return replace(v, capacity_tps=cap, accepting=not c.down)

    def _assign(self, loads: list[QueryLoad]) -> list[str]:
        views = [self._view(c) for c in self.clusters]
        return assign_batch(self.policy, loads, views, self._window_left())

    def _may_move(self, donor: ClusterView, recipient: ClusterView) -> bool:
        if self.config.policy != "cost":
            return True
        views = self._round_views  # read once a round, as the offloader reads the fleet once a tick
        m = self.market
        return move_allowed(
            views[donor.name],
            views[recipient.name],
            m.prices,
            self._round_window,
            work_per_token=self.work_per_token,
        )

    def _fill(self, donor: ClusterView, recipient: ClusterView) -> float | None:
        if self.config.policy != "cost":
            return None
        views, rule = self._round_views, self._round_fill
        until, gateway_view = rule(views[donor.name], views[recipient.name]), views[recipient.name]
        if until is None or recipient.capacity_tps <= 0:
            return until
        # in the unit of the views the moves are planned on: tokens over the cluster's own capacity, which for a
        # capacity derived from the cost model counts prompt and response tokens alike (see _view)
        return until * gateway_view.capacity_tps / recipient.capacity_tps

    def _cost_terms(self, window_left: float | None) -> dict:
        """What the cost policy's rules are made of (:mod:`gateway.assign.cost_moves`), as the offloader makes them:
        the market's prices, spot clusters and margin, the time left to the deadline, a queued token's work."""
        m = self.market
        return {
            "prices": m.prices,
            "spot": m.spot,
            "deadline_in_s": window_left,
            "spot_margin": m.spot_margin,
            "pending_work_per_token": self.work_per_token,
        }

    def _split(self, receivers: list[SimCluster], loads: list[QueryLoad]) -> list[float]:
        """A drain's targets over the receivers (tokens each)."""
        views = [self._view(x) for x in receivers]
        if self.config.policy == "cost":
            split, _ = evacuation_rules(**self._cost_terms(self._window_left()))
            return split(views, loads)
        return water_fill_targets(views, math.fsum(q.total_tokens for q in loads))

    def _tick(self) -> int:
        self._bill()
        for c in self.clusters:
            if c.down and c.queue:
                self._drain(c)
        if self.config.policy == "cost":
            self._round_views = {c.name: self._view(c) for c in self.clusters}
            self._round_window = self._window_left()
            self._round_fill = fill_rule(**self._cost_terms(self._round_window))
        moved = super()._tick() if self.config.offload else 0
        if not any(c.busy for c in self.clusters) and all(e[1] == TICK for e in self._heap):
            # nothing runs and nothing is due but ticks, which cannot change that (a cluster that never comes back)
            stuck = {c.name: len(c.queue) for c in self.clusters if c.queue}
            raise RuntimeError(
                f"simulation stalled at {self.now:.1f} s with queries queued on clusters down: {stuck}"
            )
        return moved

    def _bill(self) -> None:
        now, dollars = self.now, self.dollars
        if self._last_bill is not None:
            for name, per_s in self._billed:
                dollars[name] += per_s * (now - self._last_bill)
        self._last_bill = now
        leased = {self.outages[i].cluster for i, qs in self._leased.items() if qs}
        prices = self.market.prices
        self._billed = [
            (c.name, per_s)
            for c in self.clusters
            if (c.queue or c.engine.has_unfinished() or c.name in leased)
            and (per_s := dollars_per_second(prices, c.name)) > 0
        ]

    def _drain(self, c: SimCluster) -> None:
        """Move ``c``'s whole queue to the clusters that take work, by the drain's split (module docstring)."""
        receivers = [x for x in self.clusters if not x.down]
        if not receivers:
            return  # nowhere to go: it waits for a cluster to be back
        taken = [c.queue.pop() for _ in range(len(c.queue))]  # back first
        charge = self.charge
        loads = self._loads(taken[::-1])
        deficit = self._split(receivers, loads)
        current = -1
        for q in taken:
            if current < 0 or deficit[current] <= 0:
                current = max(range(len(receivers)), key=deficit.__getitem__)
            deficit[current] -= charge[q]
            d = receivers[current]
            d.queue.append(q, self.key[q])  # the back of its key on the receiver, as a real move
            c.queued_tokens -= charge[q]
            d.queued_tokens += charge[q]
            d.moved_in += 1
        c.moved_out += len(taken)
        self.moved += len(taken)
        self._tails = {}
        for d in receivers:
            self._kick(self.index[d.name])

    def _notice_rebalance(self, c: SimCluster) -> None:
        """The admin call of a notice under the cost policy (``gateway rebalance --preempt``): ``c``'s queue drained,
        then the balance phase of :func:`gateway.offload.rebalance.plan_moves` over the clusters up (the queued work
        placed by the cost split, the moves its rule allows), its moves made in their order."""
        if c.queue:
            self._drain(c)
        up = [x for x in self.clusters if not x.down]
        if len(up) < 2:
            return
        queued = {x.name: self._loads(x.queue.tail(len(x.queue))) for x in up}
        split, allowed = evacuation_rules(**self._cost_terms(self._window_left()))
        plan = plan_moves(
            [self._view(x) for x in up], queued, links=self.config.links, split=split, allowed=allowed
        )
        for move in plan.moves:
            self._move(move.src, move.dst, move.count)

    # ---- the clusters' side -------------------------------------------------------------------
    def _event(self, idx: int, phase: int) -> None:
        o = self.outages[idx]
        i = self.index[o.cluster]
        c = self.clusters[i]
        if phase == NOTICE:
            # outages of one cluster may overlap (a replay's): it is down until the last is over
            self._outages_on[i] += 1
            c.down = True
            stop = self.now if o.kind == "kill" else self.now + o.notice_s
            if o.kind == "kill":
                self._stop(c, idx, killed=True)
            else:
                self._push(stop, EVENT, idx, STOP)
                if self.config.policy == "cost":
                    self._notice_rebalance(c)
            if math.isfinite(o.back_t):
                self._push(max(o.back_t, stop), EVENT, idx, BACK)
        elif phase == STOP:
            self._stop(c, idx, killed=False)
        elif phase == BACK:
            self._outages_on[i] -= 1
            c.down = self._outages_on[i] > 0
            self._kick(i)
        else:  # REQUEUE: a killed engine's leases lapsed; its queries are back in its queue
            for q in self._leased.pop(idx, []):
                c.queue.append(q, self.key[q])
                c.queued_tokens += self.charge[q]
            self._kick(i)

    def _stop(self, c: SimCluster, idx: int, killed: bool) -> None:
        """``c``'s engine stops now: the queries it held go back with their partial outputs."""
        old = c.engine
        held = old.held()
        if c.busy:  # the step in flight never ends
            c.busy = False
            c.busy_s += self.now - c.step_start
        c.version += 1
        c.engine = self._make_engine(c.spec)
        c.engine.resumed = self.resumed
        for name in CARRIED:
            setattr(c.engine, name, getattr(old, name))
        for name in KV_CARRIED:
            setattr(c.engine.kv, name, getattr(old.kv, name))
        pred, resumed = self.work.predicted_tokens, self.resumed
        every = self.market.checkpoint_tokens
        half = max(1, math.ceil(every / 2)) if every > 0 else 0  # engines.checkpoints: a snapshot every half
        for q, total in held:  # total: its output now, what it resumed from included
            c.inflight_pred -= pred[q]
            generated = total - resumed[q]
            if not killed:
                keep = total  # a notice writes every token it has
            else:  # a kill keeps the last snapshot, one every `half` tokens of this run (none: what it resumed from)
                keep = resumed[q] + generated // half * half if half else resumed[q]
            self.recomputed_tokens += total - keep
            if killed:
                self.killed_running += generated > 0
            else:
                self.checkpointed += generated > 0
            resumed[q] = keep
        qids = [q for q, _ in held]
        if killed:
            self._leased[idx] = qids
            self._push(self.now + self.market.lease_s, EVENT, idx, REQUEUE)
        else:
            for q in qids:
                c.queue.append(q, self.key[q])
                c.queued_tokens += self.charge[q]

    def run(self, progress: bool = False) -> SimResult:
        for i, o in enumerate(self.outages):
            self._push(o.t, EVENT, i, NOTICE)
        result = super().run(progress)
        self._bill()  # the last interval, to the batch's end
        for name, dollars in self.dollars.items():
            result.per_cluster[name]["cost_dollars"] = round(dollars, 6)
        result.cost_dollars = math.fsum(self.dollars.values())
        result.spot = {
            "checkpointed_queries": self.checkpointed,
            "killed_running_queries": self.killed_running,
            "recomputed_tokens": self.recomputed_tokens,
            "outages": len(self.outages),
        }
        return result
