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
cluster within one query of its target (see ``docs/design/assign.md``). Cost: O(n log n + n log k).

Pure module: no Redis, no gRPC, no torch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from gateway.assign.loads import (
    AssignmentPolicy,
    ClusterView,
    NoClusterError,
    QueryLoad,
    expected_finish_s,
    fitting,
    misfit,
    no_fit,
    usable_clusters,
)

__all__ = [  # the names assignment's users import from here (defined in gateway.assign.loads)
    "AssignmentPolicy",
    "ClusterView",
    "LeastLoaded",
    "NoClusterError",
    "QueryLoad",
    "RoundRobin",
    "TokenPolicy",
    "expected_finish_s",
    "fitting",
    "misfit",
    "queue_order",
    "water_fill_targets",
]


class RoundRobin:
    """Count-based round robin over the accepting clusters; the cursor persists across calls."""

    name = "round_robin"
    longest_first = False  # the baseline keeps the batch's order

    def __init__(self) -> None:
        self._cursor = 0

    def assign(self, queries: Sequence[QueryLoad], clusters: Sequence[ClusterView]) -> list[str]:
        usable = usable_clusters(clusters)
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
                raise no_fit(q, usable)
        return out


class LeastLoaded:
    """Shortest queue first: ``queue_length`` plus this call's own assignments; ties by given order."""

    name = "least_loaded"
    longest_first = False

    def assign(self, queries: Sequence[QueryLoad], clusters: Sequence[ClusterView]) -> list[str]:
        usable = usable_clusters(clusters)
        heap = [(c.queue_length, i) for i, c in enumerate(usable)]
        heapq.heapify(heap)
        out: list[str] = []
        for q in queries:
            skipped = []
            while heap and not usable[heap[0][1]].fits(q):
                skipped.append(heapq.heappop(heap))
            if not heap:
                raise no_fit(q, usable)
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
            raise no_fit(q, clusters)
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
        usable = usable_clusters(clusters)
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
    out the finish (``docs/design/assign.md``)."""
    own = getattr(policy, "queue_order", None)  # a policy with its own order (the prefix policy's groups)
    if own is not None:
        return own(queries)
    if not policy.longest_first:
        return list(range(len(queries)))
    return sorted(
        range(len(queries)), key=lambda j: (-queries[j].predicted_tokens, -queries[j].prompt_tokens)
    )
