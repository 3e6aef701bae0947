"""What the fleet has cost so far, and costs now: the billing model of :mod:`gateway.assign.cost` metered tick by tick.

:class:`CostMeter` keeps the running totals; the offloader's tick (every 0.5 s) calls :meth:`CostMeter.update` with
what it read. A cluster is billed at its price (dollars per hour, from the cluster file:
:func:`gateway.assign.cost.fleet_prices`; by the second, :func:`gateway.assign.cost.dollars_per_second`) while it
holds work (queued or leased queries: :func:`gateway.assign.cost.holds_work`), from
the tick it was first seen holding some to the tick it is seen with none (then it is released: scaled to zero);
a cluster that never holds work costs nothing. The interval between two ticks is billed as the first of them saw
the fleet. Each interval's cost of a cluster goes to the unfinished batches with rows left there, in proportion
to their predicted tokens left there (nothing is billed to a batch on a cluster that holds none of its rows).

The totals live in the gateway's memory (the ETA board holds the meter): a restarted gateway starts them at 0,
and with several gateway replicas each meters the fleet it sees. Shown by the status page, ``fleetbatch gateway
status`` and Prometheus (``fleetbatch_fleet_cost_*``, ``fleetbatch_batch_cost_dollars``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway.assign.cost import dollars_per_second, holds_work
from protos import fleetbatch_pb2 as pb
from workqueue import BatchInfo, ClusterInfo

KEEP_BATCHES = 10_000  # batches whose cost so far is kept (the oldest go first)
MAX_GAP_S = 60.0  # a longer gap between two ticks (the gateway paused) is billed as this long


@dataclass(frozen=True)
class ClusterCost:
    """One cluster's price (dollars per hour; None: not known, billed at 0), whether it is billed now, and what it
    has cost so far (dollars)."""

    price_per_hour: float | None
    billed: bool
    dollars: float


class CostMeter:
    """The fleet's cost so far and rate now, per cluster and per batch (thread-safe; see the module docstring)."""

    def __init__(self, prices: Mapping[str, float] | None = None) -> None:
        self.prices = dict(prices or {})
        self._lock = threading.Lock()
        self._last: float | None = None
        self._billed: dict[str, float] = {}  # cluster -> price per second, while it holds work
        self._shares: dict[str, dict[str, float]] = {}  # cluster -> batch -> share of its cost now
        self._clusters: dict[str, float] = {}
        self._batches: OrderedDict[str, float] = OrderedDict()
        self.spent = 0.0  # dollars, the whole fleet

    def update(self, now: float, infos: Sequence[ClusterInfo], batches: Sequence[BatchInfo]) -> None:
        """Bill the interval since the last tick as the last tick saw the fleet, then take this tick's view."""
        with self._lock:
            dt = min(max(0.0, now - self._last), MAX_GAP_S) if self._last is not None else 0.0
            for name, per_s in self._billed.items():
                cost = per_s * dt
                self.spent += cost
                self._clusters[name] = self._clusters.get(name, 0.0) + cost
                for batch_id, share in self._shares.get(name, {}).items():
                    self._batches[batch_id] = self._batches.get(batch_id, 0.0) + cost * share
            self._last = now
            self._billed = {i.name: dollars_per_second(self.prices, i.name) for i in infos if holds_work(i)}
            self._shares = _shares(self._billed, batches)
            for b in batches:  # each unfinished batch is listed (at 0 until billed), newest last
                self._batches.setdefault(b.batch_id, 0.0)
            while len(self._batches) > KEEP_BATCHES:
                self._batches.popitem(last=False)

    def rate_per_hour(self) -> float:
        """Dollars per hour the fleet costs now: the prices of the clusters that hold work."""
        with self._lock:
            return sum(self._billed.values()) * 3600.0

    def batch(self, batch_id: str) -> float | None:
        """Dollars billed to the batch so far (None: not seen by the meter)."""
        with self._lock:
            return self._batches.get(batch_id)

    def cluster(self, name: str) -> ClusterCost:
        with self._lock:
            return ClusterCost(self.prices.get(name), name in self._billed, self._clusters.get(name, 0.0))

    def batch_rates(self) -> dict[str, float]:
        """Dollars per hour each unfinished batch is billed now."""
        with self._lock:
            out: dict[str, float] = {}
            for name, per_s in self._billed.items():
                for batch_id, share in self._shares.get(name, {}).items():
                    out[batch_id] = out.get(batch_id, 0.0) + per_s * share * 3600.0
            return out


def _shares(billed: Mapping[str, float], batches: Sequence[BatchInfo]) -> dict[str, dict[str, float]]:
    """Per billed cluster, each unfinished batch's share of its predicted tokens left there."""
    out: dict[str, dict[str, float]] = {}
    for name in billed:
        left = {
            b.batch_id: t
            for b in batches
            if not b.final and (t := b.left_tokens_per_cluster.get(name, 0.0)) > 0
        }
        total = sum(left.values())
        if total > 0:
            out[name] = {batch_id: t / total for batch_id, t in left.items()}
    return out


def priced(resp: pb.ListClustersResponse, meter: CostMeter) -> pb.ListClustersResponse:
    """``resp`` with the fleet's cost rate and cost so far, and each cluster's price, billing and cost so far."""
    resp.cost_per_hour = meter.rate_per_hour()
    resp.cost_dollars = meter.spent
    for c in resp.clusters:
        cost = meter.cluster(c.name)
        c.price_per_hour, c.billed, c.cost_dollars = cost.price_per_hour or 0.0, cost.billed, cost.dollars
    return resp
