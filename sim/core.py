"""The event loop: arrivals, engine step completions and offloader ticks in cost-model time.

Per cluster there is a queue (:class:`sim.queues.OrderedQueue`: by batch key, as the Redis one) and a
simulated engine (:mod:`sim.engines`). Arriving queries are assigned by the real policy of
:mod:`gateway.assign.policies` from :class:`~gateway.assign.policies.ClusterView` objects built as
:func:`gateway.assign.views.cluster_views` does (pending = queued prompt + predicted tokens plus the
predicted tokens of queries the engine holds, the capacity being the configured hint). Before
every step an engine takes ``free_slots()`` queries from the front of its queue (the worker's
loop); an idle engine takes work the moment it appears. Every ``offload_interval_s`` the
offloader runs :class:`gateway.offload.offloader.Offloader`'s round with the real
:func:`gateway.offload.moves.plan_offload` and one :class:`gateway.offload.moves.Backoff` per cluster on the
simulated clock; a move takes queries from the back of the donor's queue to the back of their batch's
key in the recipient's (the real queue keeps their submission place), at once (the link cost only
enters the decision, as in the real system). A queued query whose batch's deadline passed expires.

Events at the same instant run in the order: step completions, arrivals, offloader ticks.
"""

from __future__ import annotations

import gc
import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engines.config import EngineConfig
from gateway.assign.estimates import charged_tokens
from gateway.assign.policies import ClusterView, QueryLoad, queue_order
from gateway.assign.registry import make_policy
from gateway.offload.moves import Backoff, LinkCost, plan_offload
from sim.cluster import ClusterSpec, SimCluster
from sim.engines import IterationEngine, StaticEngine
from sim.pipelined import PipelinedEngine
from sim.result import SimResult
from sim.workload import Workload

STEP, ARRIVE, TICK, EVENT = 0, 1, 2, 3  # EVENT: a subclass's own (sim.spot: notices, kills, clusters back)


@dataclass
class SimConfig:
    policy: str = "token"
    offload: bool = True
    offload_interval_s: float = 0.5  # gateway default
    lookahead_s: float = 2.0  # OffloadConfig defaults from here down
    tail_len: int = 256
    links: LinkCost = field(default_factory=LinkCost)
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    max_tokens: int = 256
    block_size: int = 16
    max_batch_tokens: int = 512
    prefill_chunk: int = 256
    safety_margin: float = 0.10
    bulk: bool = True
    prefix_cache: bool = True  # the engines' prefix cache (fleetbatch engine serve --no-prefix-cache: False)


class Simulator:
    def __init__(self, specs: list[ClusterSpec], work: Workload, config: SimConfig | None = None) -> None:
        if not specs:
            raise ValueError("need at least one cluster")
        self.config = cfg = config or SimConfig()
        self.work = work
        self.policy = make_policy(cfg.policy)
        self.uses_prefixes = getattr(self.policy, "uses_prefixes", False)
        self.total = [p + r for p, r in zip(work.prompt_tokens, work.predicted_tokens, strict=True)]
        self.charge = list(self.total)  # what each query adds to its queue's pending: its group's prefix once
        self.key = work.order_key or [0.0] * len(work.prompt_tokens)  # each query's place in the queues
        self.expired: set[int] = set()  # queries whose batch's deadline passed while they were queued
        n = max(1, len(work))
        mean_p = sum(work.prompt_tokens) / n
        mean_r = sum(work.predicted_tokens) / n
        self.clusters: list[SimCluster] = []
        for s in specs:
            engine = self._make_engine(s)
            if s.backend == "pipelined":
                cap = s.capacity_tps or engine.predicted_tokens_per_s
            else:
                cap = s.capacity_tps or s.cost.tokens_per_s(s.batch, mean_p, mean_r)
            self.clusters.append(SimCluster(s, engine, cap))
        self.backoffs: dict[str, Backoff] = {}
        self.now = 0.0
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._order = 0
        self.moved = 0
        self.assigned = [-1] * len(work)  # cluster index the policy chose for each query (before any move)
        self._tails: dict[str, list[QueryLoad]] = {}

    def _make_engine(self, s: ClusterSpec):
        """A fresh engine for cluster ``s`` (an empty KV cache; :mod:`sim.spot` restarts one this way)."""
        cfg, work = self.config, self.work
        ec = EngineConfig(
            kv_budget_tokens=s.kv_budget_tokens,
            block_size=cfg.block_size,
            max_batch_tokens=cfg.max_batch_tokens,
            prefill_chunk=cfg.prefill_chunk,
            max_running=s.batch,
            safety_margin=cfg.safety_margin,
            prefix_cache=cfg.prefix_cache,
        )
        if s.backend == "iteration":
            return IterationEngine(ec, s.cost, work, cfg.max_tokens, bulk=cfg.bulk)
        if s.backend == "static":
            return StaticEngine(s.batch, s.cost, work, cfg.max_tokens)
        if s.backend == "pipelined" and s.plan:
            return PipelinedEngine(s.plan, ec, work, cfg.max_tokens)
        raise ValueError(
            f"unknown backend {s.backend!r}; choose iteration, static or pipelined (with a plan)"
        )

    # ---- events -----------------------------------------------------------------------------
    def _push(self, t: float, kind: int, idx: int, version: int = 0) -> None:
        self._order += 1
        heapq.heappush(self._heap, (t, kind, self._order, idx, version))

    def _clock(self) -> float:
        return self.now

    def run(self, progress: bool = False) -> SimResult:
        """Simulate until every query finished. The garbage collector is paused meanwhile (the loop makes
        millions of short-lived objects and no reference cycles; collections cost ~10 % of the time)."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(progress)
        finally:
            if enabled:
                gc.enable()

    def _run(self, progress: bool) -> SimResult:
        from tqdm import tqdm

        t_wall = time.perf_counter()
        w, n = self.work, len(self.work)
        order = sorted(range(n), key=w.arrival_s.__getitem__)
        groups: list[tuple[float, list[int]]] = []
        for q in order:
            t = w.arrival_s[q]
            if groups and groups[-1][0] == t:
                groups[-1][1].append(q)
            else:
                groups.append((t, [q]))
        for gi, (t, _) in enumerate(groups):
            self._push(t, ARRIVE, gi)
        if self._ticks():
            self._push(groups[0][0] if groups else 0.0, TICK, 0)
        self.finish_s = finish = [0.0] * n
        self.done = 0
        self._bar = bar = tqdm(total=n, disable=not progress, desc="simulate", unit="query", mininterval=0.5)
        heap = self._heap
        while heap and self.done < n:
            t, kind, _, idx, version = heapq.heappop(heap)
            self.now = t
            if kind == STEP:
                c = self.clusters[idx]
                if version != c.version:
                    continue
                c.busy = False
                c.busy_s += t - c.step_start
                self._finished(c, c.engine.end_step())
                self._kick(idx)
            elif kind == ARRIVE:
                self._arrive(groups[idx][1])
            elif kind == TICK:
                self._tick()
                if self.done < n:
                    self._push(t + self.config.offload_interval_s, TICK, 0)
            else:
                self._event(idx, version)
        bar.close()
        if self.done < n:
            raise RuntimeError(f"simulation stalled with {n - self.done} of {n} queries unfinished")
        start = groups[0][0] if groups else 0.0
        per = {c.name: c.summary() for c in self.clusters}
        return SimResult(
            makespan_s=max(finish, default=start) - start,
            queries=n,
            generated_tokens=sum(c.engine.generated_tokens for c in self.clusters),
            kv_token_seconds=sum(c.engine.kv_token_seconds for c in self.clusters),
            kv_cached_token_seconds=sum(c.engine.kv_cached_token_seconds for c in self.clusters),
            cumulative_kv_tokens=sum(c.engine.cumulative_kv_tokens for c in self.clusters),
            moved=self.moved,
            finish_s=finish,
            per_cluster=per,
            wall_s=time.perf_counter() - t_wall,
            prefill_tokens=sum(p["prefill_tokens"] for p in per.values()),
            prefix_hit_tokens=sum(p.get("hit_tokens", 0) for p in per.values()),
            prefix_lookup_tokens=sum(p.get("lookup_tokens", 0) for p in per.values()),
        )

    # ---- clusters ---------------------------------------------------------------------------
    def _finished(self, c: SimCluster, qids: list[int]) -> None:
        """Record queries that finished now, and those the engine failed (larger than its whole KV cache)."""
        e = c.engine
        if e.failed:
            c.failed += len(e.failed)
            qids = qids + e.failed
            e.failed.clear()
        if not qids:
            return
        pred, finish, t = self.work.predicted_tokens, self.finish_s, self.now
        for q in qids:
            finish[q] = t
            c.inflight_pred -= pred[q]
        c.finished += len(qids)
        self.done += len(qids)
        self._bar.update(len(qids))

    def _kick(self, idx: int) -> None:
        """Start the cluster's next step if it is idle; cut a bulk short if it would take new work."""
        c = self.clusters[idx]
        e = c.engine
        if c.busy:
            if e.in_bulk and c.queue and e.free_slots() > 0:
                d = e.cut_bulk(self.now - c.step_start)
                if d is not None:
                    c.version += 1
                    self._push(c.step_start + d, STEP, idx, c.version)
            return
        self._pull(c)
        d = e.start_step()
        if e.failed:
            self._finished(c, [])
        if d is None:
            return
        c.busy = True
        c.step_start = self.now
        c.version += 1
        self._push(self.now + d, STEP, idx, c.version)

    def _pull(self, c: SimCluster) -> None:
        if c.down:  # a preempted or killed cluster takes no work (sim.spot)
            return
        n, total, pred = c.engine.free_slots(), self.charge, self.work.predicted_tokens
        deadline, expired = self.work.deadline_s, []
        while n > 0 and c.queue:
            q = c.queue.popleft()
            c.queued_tokens -= total[q]
            if deadline is not None and 0 < deadline[q] < self.now:  # its batch's window ended: it never runs
                expired.append(q)
                continue
            c.inflight_pred += pred[q]
            c.engine.add(q)
            n -= 1
        if expired:  # finished now, never run (_finished takes their predicted tokens off again)
            self.expired.update(expired)
            c.inflight_pred += sum(pred[q] for q in expired)
            self._finished(c, expired)

    def _ticks(self) -> bool:
        """Whether the offloader ticks (:mod:`sim.spot` bills and drains at every tick)."""
        return self.config.offload and len(self.clusters) > 1

    def _event(self, idx: int, phase: int) -> None:
        raise NotImplementedError("the plain simulator schedules no events of its own")

    def _assign(self, loads: list[QueryLoad]) -> list[str]:
        """The policy's cluster for each arriving query (:mod:`sim.spot` gives the cost policy its window)."""
        return self.policy.assign(loads, [c.view() for c in self.clusters])

    def _arrive(self, qids: list[int]) -> None:
        w = self.work  # a policy that ignores prefix groups is given none, as the gateway gives it none
        loads = [w.load(q) if self.uses_prefixes else w.load(q, plain=True) for q in qids]
        names = self._assign(loads)
        index = {c.name: i for i, c in enumerate(self.clusters)}
        touched = set()
        order = queue_order(self.policy, loads)  # as the gateway enqueues them, and charges them
        charges = charged_tokens([loads[j] for j in order], [names[j] for j in order])
        for j, charge in zip(order, charges, strict=True):
            q, i = qids[j], index[names[j]]
            self.assigned[q] = i
            c = self.clusters[i]
            c.queue.append(q, self.key[q])
            self.charge[q] = charge
            c.queued_tokens += charge
            touched.add(i)
        for i in sorted(touched):
            self._kick(i)

    # ---- the offloader ----------------------------------------------------------------------
    def _backoff(self, name: str) -> Backoff:
        b = self.backoffs.get(name)
        if b is None:
            cfg = self.config
            b = self.backoffs[name] = Backoff(cfg.backoff_base_s, max_s=cfg.backoff_max_s, clock=self._clock)
        return b

    def _tick(self) -> int:
        """One round of :meth:`gateway.offload.offloader.Offloader._offload` (no dead clusters to evacuate here)."""
        cfg = self.config
        candidates = [
            c
            for c in self.clusters
            if not c.queue
            and not c.down
            and c.queued_tokens + c.inflight_pred <= c.capacity * cfg.lookahead_s
            and self._backoff(c.name).ready()
        ]
        if not candidates:
            return 0
        views = {c.name: c.view() for c in self.clusters}
        busy = [c for c in self.clusters if c.queue]
        moved = 0
        self._tails = {}  # read once per tick; a move drops its source's entry (the real one re-reads Redis)
        for c in candidates:
            v = views[c.name]
            threshold = v.capacity_tps * cfg.lookahead_s
            backoff = self._backoff(c.name)
            tails = {
                b.name: self._tail(b)
                for b in busy
                if b is not c and b.queue and self._may_move(views[b.name], v)
            }
            move = plan_offload(
                v,
                [views[n] for n in tails],
                tails,
                cfg.links,
                idle_threshold_tokens=threshold,
                fill=self._fill,
            )
            if move is None:
                backoff.failed()
                continue
            if self._move(move.src, move.dst, move.count) > 0:
                backoff.succeeded()
                moved += move.count
            else:
                backoff.failed()
        return moved

    def _may_move(self, donor: ClusterView, recipient: ClusterView) -> bool:
        """Whether the offloader may move queued work from ``donor`` to ``recipient`` (the cost policy's rule in
        :mod:`sim.spot`; here, always)."""
        return True

    def _fill(self, donor: ClusterView, recipient: ClusterView) -> float | None:
        """How far ``recipient`` may fill with ``donor``'s queued work past equal finish times (the cost policy's
        :func:`gateway.assign.cost_moves.fill_rule` in :mod:`sim.spot`; here, not at all)."""
        return None

    def _tail(self, c: SimCluster) -> list[QueryLoad]:
        """:func:`gateway.assign.views.queued_loads` of ``c``: its last ``tail_len`` queued queries, front first."""
        tail = self._tails.get(c.name)
        if tail is None:
            tail = self._loads(c.queue.tail(self.config.tail_len))
            self._tails[c.name] = tail
        return tail

    def _loads(self, queries: Sequence[int]) -> list[QueryLoad]:
        """Queued queries as the gateway's views count them: each at its full charged size, no prompt apart."""
        total = self.charge
        return [QueryLoad(str(q), 0, total[q]) for q in queries]

    def _move(self, src: str, dst: str, count: int) -> int:
        by = {c.name: i for i, c in enumerate(self.clusters)}
        s, di = self.clusters[by[src]], by[dst]
        d = self.clusters[di]
        taken = [s.queue.pop() for _ in range(min(count, len(s.queue)))]
        for q in reversed(taken):
            d.queue.append(q, self.key[q])
            s.queued_tokens -= self.charge[q]
            d.queued_tokens += self.charge[q]
        self._tails.pop(src, None)
        self._tails.pop(dst, None)
        s.moved_out += len(taken)
        d.moved_in += len(taken)
        self.moved += len(taken)
        if taken:
            self._kick(di)
        return len(taken)
