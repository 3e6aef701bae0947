"""Assignment policies: which cluster gets each query of a batch.

Five policies behind one interface (:class:`AssignmentPolicy`), chosen by name with
:func:`make_policy`:

* ``round_robin`` -- count-based, keeps its cursor across calls.
* ``least_loaded`` -- shortest queue (``queue_length`` plus what this call already put there).
* ``token_equal`` -- MICO §3.3: queries sorted by expected length (prompt + predicted
  response tokens), longest first, each given to the cluster with the largest remaining
  token deficit against an *equal* share of the batch. Sorting is MICO's "longest groups
  first"; the deficit rule spreads every group over the clusters, and a group that does
  not divide evenly spills into the next one (MICO's "borrow from the next group").
* ``token`` -- the same fill, but each cluster's target is its capacity-proportional share
  of all work (pending + new) less the work it already holds (water filling), so that
  expected finish times ``(pending + assigned) / capacity`` come out equal.
* ``prefix`` -- ``token`` with prefix groups kept whole (:mod:`gateway.assign.prefix_policy`).

Every policy is memory aware: a query goes only where it fits (``max_query_tokens`` and
``kv_budget_tokens``). The token policies also prefer clusters whose KV budget can run at
least ``min_concurrency`` queries of that length at once, so long queries are not piled on
a cluster with little KV memory. Largest-deficit-first over a descending sort keeps every
cluster within one query of its target (see ``docs/assign.md``). Cost: O(n log n + n log k).

Pure module: no Redis, no gRPC, no torch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import Protocol


class NoClusterError(RuntimeError):
    """No cluster accepts work, or a query fits on no accepting cluster."""


@dataclass(frozen=True)
class QueryLoad:
    """One query as the assigner sees it: a key, its token counts, its prefix group (:mod:`gateway.assign.prefixes`)."""

    key: str
    prompt_tokens: int
    predicted_tokens: float
    prefix_group: str | None = None
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if (
            isinstance(self.prompt_tokens, bool)
            or not isinstance(self.prompt_tokens, int)
            or self.prompt_tokens < 0
        ):
            raise ValueError(
                f"query {self.key!r}: prompt_tokens must be an int >= 0, not {self.prompt_tokens!r}"
            )
        p = self.predicted_tokens
        if not isinstance(p, int | float) or not math.isfinite(p) or p < 0:
            raise ValueError(f"query {self.key!r}: predicted_tokens must be a finite number >= 0, not {p!r}")
        if not 0 <= self.prefix_tokens <= (self.prompt_tokens if self.prefix_group is not None else 0):
            raise ValueError(f"query {self.key!r}: bad prefix_tokens {self.prefix_tokens!r}")

    @property
    def total_tokens(self) -> float:
        """Prompt + predicted response tokens (what the query costs in KV and in time)."""
        return self.prompt_tokens + self.predicted_tokens


@dataclass(frozen=True)
class ClusterView:
    """What the assigner knows about one cluster at decision time."""

    name: str
    capacity_tps: float
    pending_tokens: float = 0.0
    queue_length: int = 0
    max_query_tokens: int | None = None
    kv_budget_tokens: int | None = None
    accepting: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("cluster name must not be empty")
        for field_name in ("capacity_tps", "pending_tokens"):
            v = getattr(self, field_name)
            if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(
                    f"cluster {self.name!r}: {field_name} must be a finite number >= 0, not {v!r}"
                )
        if self.queue_length < 0:
            raise ValueError(f"cluster {self.name!r}: queue_length must be >= 0, not {self.queue_length}")
        for field_name in ("max_query_tokens", "kv_budget_tokens"):
            v = getattr(self, field_name)
            if v is not None and v <= 0:
                raise ValueError(f"cluster {self.name!r}: {field_name} must be > 0 or None, not {v!r}")

    @property
    def usable(self) -> bool:
        """Accepting and with positive capacity."""
        return self.accepting and self.capacity_tps > 0

    @property
    def query_limit(self) -> float:
        """Longest prompt + response one query may have here (``inf`` when unknown)."""
        limits = [v for v in (self.max_query_tokens, self.kv_budget_tokens) if v is not None]
        return float(min(limits)) if limits else math.inf

    def fits(self, q: QueryLoad) -> bool:
        """Whether ``q`` can run here at all."""
        return q.total_tokens <= self.query_limit


def expected_finish_s(c: ClusterView, extra_tokens: float = 0.0) -> float:
    """Seconds until ``c`` finishes its pending work plus ``extra_tokens`` (``inf`` with work and no capacity)."""
    work = c.pending_tokens + extra_tokens
    if work <= 0:
        return 0.0
    return work / c.capacity_tps if c.capacity_tps > 0 else math.inf


class AssignmentPolicy(Protocol):
    """Maps a batch of queries to cluster names (same order as ``queries``).

    ``longest_first``: its queries enter their queues longest first (:func:`queue_order`), else
    in the order given."""

    name: str
    longest_first: bool

    def assign(self, queries: Sequence[QueryLoad], clusters: Sequence[ClusterView]) -> list[str]: ...


def _usable(clusters: Sequence[ClusterView]) -> list[ClusterView]:
    names = [c.name for c in clusters]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate cluster names: {', '.join(dup)}")
    usable = [c for c in clusters if c.usable]
    if not usable:
        raise NoClusterError(
            "no cluster accepts work (all draining, dead or with zero capacity)"
            if clusters
            else "no clusters given"
        )
    return usable


def fitting(q: QueryLoad, clusters: Sequence[ClusterView]) -> list[ClusterView]:
    """The clusters of ``clusters`` that can take ``q`` (:meth:`ClusterView.fits`)."""
    return [c for c in clusters if c.fits(q)]


def misfit(q: QueryLoad, clusters: Sequence[ClusterView], which: str = "accepting") -> str | None:
    """The one rule of whether a query fits anywhere: None when a cluster of ``clusters`` can take
    ``q`` (or none is given), else why not, naming the largest per-query limit among them.

    ``which`` names the set the caller passes: ``accepting`` (the usable clusters, which take work
    now: assignment, drains, moves) or ``configured`` (every active cluster, alive or not: a
    query that fits none of them never will, :mod:`gateway.assign.placement`)."""
    if not clusters or any(c.fits(q) for c in clusters):
        return None
    best = max(c.query_limit for c in clusters)
    return (
        f"query {q.key!r} needs {q.total_tokens:g} tokens (prompt + predicted); the largest per-query limit "
        f"of any {which} cluster is {best:g}"
    )


def _no_fit(q: QueryLoad, clusters: Sequence[ClusterView]) -> NoClusterError:
    return NoClusterError(misfit(q, clusters) or f"query {q.key!r} fits no cluster")


class RoundRobin:
    """Count-based round robin over the accepting clusters; the cursor persists across calls."""

    name = "round_robin"
    longest_first = False  # the baseline keeps the batch's order

    def __init__(self) -> None:
        self._cursor = 0

    def assign(self, queries: Sequence[QueryLoad], clusters: Sequence[ClusterView]) -> list[str]:
        usable = _usable(clusters)
        k = len(usable)
        out: list[str] = []
        for q in queries:
            for step in range(k):
                c = usable[(self._cursor + step) % k]
                if c.fits(q):
                    out.append(c.name)
                    self._cursor = (self._cursor + step + 1) % k
                    break
            else:
                raise _no_fit(q, usable)
        return out


class LeastLoaded:
    """Shortest queue first: ``queue_length`` plus this call's own assignments; ties by given order."""

    name = "least_loaded"
    longest_first = False

    def assign(self, queries: Sequence[QueryLoad], clusters: Sequence[ClusterView]) -> list[str]:
        usable = _usable(clusters)
        heap = [(c.queue_length, i) for i, c in enumerate(usable)]
        heapq.heapify(heap)
        out: list[str] = []
        for q in queries:
            skipped = []
            while heap and not usable[heap[0][1]].fits(q):
                skipped.append(heapq.heappop(heap))
            if not heap:
                raise _no_fit(q, usable)
            length, i = heap[0]
            heapq.heapreplace(heap, (length + 1, i))
            out.append(usable[i].name)
            for item in skipped:
                heapq.heappush(heap, item)
        return out


def water_fill_targets(clusters: Sequence[ClusterView], new_tokens: float) -> list[float]:
    """Tokens of ``new_tokens`` each cluster should get so that finish times equalise.

    Solves for the level ``T`` with ``sum_c max(0, T * cap_c - pending_c) = new_tokens``;
    cluster ``c`` gets ``max(0, T * cap_c - pending_c)``. Clusters must have capacity > 0.
    """
    if new_tokens < 0:
        raise ValueError(f"new_tokens must be >= 0, not {new_tokens}")
    if any(c.capacity_tps <= 0 for c in clusters):
        raise ValueError("water filling needs clusters with capacity > 0")
    order = sorted(range(len(clusters)), key=lambda i: clusters[i].pending_tokens / clusters[i].capacity_tps)
    cap_sum = 0.0
    work_sum = 0.0
    level = 0.0
    for rank, i in enumerate(order):
        c = clusters[i]
        cap_sum += c.capacity_tps
        work_sum += c.pending_tokens
        level = (work_sum + new_tokens) / cap_sum
        nxt = order[rank + 1] if rank + 1 < len(order) else None
        if nxt is None or level <= clusters[nxt].pending_tokens / clusters[nxt].capacity_tps:
            break
    return [max(0.0, level * c.capacity_tps - c.pending_tokens) for c in clusters]


def deficit_fill(
    queries: Sequence[QueryLoad],
    clusters: Sequence[ClusterView],
    targets: Sequence[float],
    min_concurrency: int = 1,
) -> list[int]:
    """Index into ``clusters`` per query: longest query first to the largest remaining deficit.

    A query prefers clusters whose KV budget holds ``min_concurrency`` copies of it; when
    none does, any cluster it fits on; when none, :class:`NoClusterError`.
    """
    k = len(clusters)
    if len(targets) != k:
        raise ValueError(f"{k} clusters but {len(targets)} targets")
    sizes = [q.total_tokens for q in queries]
    order = sorted(range(len(queries)), key=sizes.__getitem__, reverse=True)  # stable: ties keep input order

    def soft_limit(c: ClusterView) -> float:
        lim = c.query_limit
        if c.kv_budget_tokens is not None and min_concurrency > 1:
            lim = min(lim, c.kv_budget_tokens / min_concurrency)
        return lim

    out = [0] * len(queries)
    largest = sizes[order[0]] if order else 0.0
    if all(soft_limit(c) >= largest for c in clusters):
        # Fast path: every query fits everywhere; one max-heap of (-deficit, index).
        heap = [(-float(t), i) for i, t in enumerate(targets)]
        heapq.heapify(heap)
        for j in order:
            neg, i = heap[0]
            out[j] = i
            heapq.heapreplace(heap, (neg + sizes[j], i))
        return out

    deficit = [float(t) for t in targets]
    # Two tiers of eligibility, each a max-heap of (-deficit, index) with lazy stale entries.
    # Queries arrive longest first, so a cluster, once eligible, stays eligible.
    tiers = []
    for limit_of in (soft_limit, lambda c: c.query_limit):
        by_limit = sorted(range(k), key=lambda i, f=limit_of: -f(clusters[i]))
        tiers.append(
            {"limit": [limit_of(clusters[i]) for i in by_limit], "order": by_limit, "next": 0, "heap": []}
        )
    member = [[False] * k for _ in tiers]

    for j in order:
        q = queries[j]
        size = sizes[j]
        chosen = -1
        for t, tier in enumerate(tiers):
            while tier["next"] < k and tier["limit"][tier["next"]] >= size:
                i = tier["order"][tier["next"]]
                heapq.heappush(tier["heap"], (-deficit[i], i))
                member[t][i] = True
                tier["next"] += 1
            heap = tier["heap"]
            while heap and -heap[0][0] != deficit[heap[0][1]]:
                heapq.heappop(heap)
            if heap:
                chosen = heap[0][1]
                break
        if chosen < 0:
            raise _no_fit(q, clusters)
        deficit[chosen] -= size
        for t, tier in enumerate(tiers):
            if member[t][chosen]:
                heapq.heappush(tier["heap"], (-deficit[chosen], chosen))
        out[j] = chosen
    return out


class TokenPolicy:
    """Token-granular assignment (MICO §3.3), optionally capacity- and load-aware."""

    def __init__(self, capacity_aware: bool = True, min_concurrency: int = 1) -> None:
        if min_concurrency < 1:
            raise ValueError(f"min_concurrency must be >= 1, not {min_concurrency}")
        self.capacity_aware = capacity_aware
        self.min_concurrency = min_concurrency
        self.name = "token" if capacity_aware else "token_equal"
        self.longest_first = True  # MICO's longest groups first, kept in the queues (queue_order)

    def targets(self, queries: Sequence[QueryLoad], clusters: Sequence[ClusterView]) -> list[float]:
        """Target tokens of this batch per (usable) cluster, in the order given."""
        new = math.fsum(q.total_tokens for q in queries)
        if self.capacity_aware:
            return water_fill_targets(clusters, new)
        return [new / len(clusters)] * len(clusters)

    def assign(self, queries: Sequence[QueryLoad], clusters: Sequence[ClusterView]) -> list[str]:
        usable = _usable(clusters)
        if not queries:
            return []
        idx = deficit_fill(queries, usable, self.targets(queries, usable), self.min_concurrency)
        return [usable[i].name for i in idx]


def queue_order(policy: AssignmentPolicy, queries: Sequence[QueryLoad]) -> list[int]:
    """The order in which a batch's queries (or an intake chunk's) enter their clusters' queues under
    ``policy``: the token policies put the longest predicted response first (ties: the longer
    prompt, then input order); the others keep the input order.

    Longest-first is the classic rule for an even finish on machines that take work as they free
    up (LPT): long queries start early, and what is left in a queue at the end is short. That short
    tail is also what the offloader moves from a busy cluster to an idle one: cheap moves that even
    out the finish (``docs/assign.md``)."""
    own = getattr(policy, "queue_order", None)  # a policy with its own order (the prefix policy's groups)
    if own is not None:
        return own(queries)
    if not policy.longest_first:
        return list(range(len(queries)))
    return sorted(
        range(len(queries)), key=lambda j: (-queries[j].predicted_tokens, -queries[j].prompt_tokens)
    )


POLICIES: dict[str, Callable[[], AssignmentPolicy]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "token": lambda: TokenPolicy(capacity_aware=True),
    "token_equal": lambda: TokenPolicy(capacity_aware=False),
    "prefix": lambda: import_module(
        "gateway.assign.prefix_policy"
    ).PrefixPolicy(),  # it builds on this module
}


def make_policy(name: str) -> AssignmentPolicy:
    """A fresh policy by name; ``ValueError`` naming the choices when unknown."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown assignment policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return factory()
