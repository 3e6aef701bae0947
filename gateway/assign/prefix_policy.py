"""The ``prefix`` policy: ``token``'s capacity-aware balance, with prefix groups kept whole (issue [5/6]).

A prefix group (:mod:`gateway.assign.prefixes`: rows that share a long head of tokens) costs its
cluster the shared prefill once, while it stays in that cluster's prefix cache; spread over
``k`` clusters it costs ``k`` times, and its rows, mixed with others in each queue, evict each
other's prefixes. So:

* **Units.** A group is one unit, a row with no group a unit of its own. A unit's *charged*
  tokens are its rows' prompt + predicted tokens with the shared prefix counted once
  (:func:`gateway.assign.estimates.charged`): ``sum(total - prefix) + max(prefix)``.
* **Targets.** ``token``'s water filling over the charged tokens of the batch.
* **Fill.** Units largest first, each to the cluster with the largest remaining deficit among
  those that fit its largest row (MICO's longest-first fill, with units for queries).
* **Splits.** A group is split only when its charged tokens exceed the largest target (no
  cluster's share of this batch holds it) or no one cluster fits all its rows. It is then cut
  into as few pieces as the deficits allow: each piece fills the largest remaining deficit, in
  the batch's order, the rest goes whole once it fits one.
* **Queue order** (:meth:`PrefixPolicy.queue_order`): units longest predicted response first (its
  longest row), a group's rows next to each other, longest first inside it; so each cluster's
  queue holds a group's rows together and its prefix stays cached while they run.

A batch without groups is assigned exactly as ``token`` assigns it. Pure module.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from gateway.assign.estimates import charged
from gateway.assign.loads import ClusterView, QueryLoad, no_fit, usable_clusters
from gateway.assign.policies import TokenPolicy, water_fill_targets


def units(queries: Sequence[QueryLoad]) -> list[list[int]]:
    """Indices of ``queries`` per unit: one per group (its rows in input order), one per row with no group;
    in order of first appearance."""
    by_group: dict[str, list[int]] = {}
    out: list[list[int]] = []
    for j, q in enumerate(queries):
        if q.prefix_group is None:
            out.append([j])
        elif q.prefix_group in by_group:
            by_group[q.prefix_group].append(j)
        else:
            by_group[q.prefix_group] = [j]
            out.append(by_group[q.prefix_group])
    return out


class _Fill:
    """Remaining deficits of the usable clusters, largest first through a lazy max-heap."""

    def __init__(self, usable: Sequence[ClusterView], targets: Sequence[float]) -> None:
        self.usable = usable
        self.deficit = [float(t) for t in targets]
        self.heap = [(-d, i) for i, d in enumerate(self.deficit)]
        heapq.heapify(self.heap)

    def best(self, need: float) -> int:
        """The cluster with the largest deficit among those a query of ``need`` tokens fits (-1: none)."""
        popped, chosen = [], -1
        while self.heap:
            neg, i = heapq.heappop(self.heap)
            if -neg != self.deficit[i]:
                continue  # stale
            popped.append((neg, i))
            if self.usable[i].query_limit >= need:
                chosen = i
                break
        for item in popped:
            heapq.heappush(self.heap, item)
        return chosen

    def put(self, i: int, tokens: float) -> None:
        self.deficit[i] -= tokens
        heapq.heappush(self.heap, (-self.deficit[i], i))


class PrefixPolicy:
    """Token-granular, capacity-aware assignment that keeps prefix groups whole (module docstring)."""

    name = "prefix"
    longest_first = True
    uses_prefixes = True  # the gateway finds each row's prefix group for it (gateway.assign.prefixes)

    def __init__(self) -> None:
        self._token = TokenPolicy(capacity_aware=True)

    def assign(self, queries: Sequence[QueryLoad], clusters: Sequence[ClusterView]) -> list[str]:
        usable = usable_clusters(clusters)
        if not any(q.prefix_group is not None for q in queries):
            return self._token.assign(queries, clusters)  # exactly as before
        groups = units(queries)
        cost = [charged([queries[j] for j in u]) for u in groups]
        targets = water_fill_targets(usable, math.fsum(cost))
        fill = _Fill(usable, targets)
        out = [""] * len(queries)
        for u in sorted(range(len(groups)), key=lambda u: -cost[u]):  # stable: ties keep input order
            members = groups[u]
            need = max(queries[j].total_tokens for j in members)
            i = fill.best(need)
            share = max(
                (t for c, t in zip(usable, targets, strict=True) if c.query_limit >= need), default=0.0
            )
            if i >= 0 and (len(members) == 1 or cost[u] <= share):
                fill.put(i, cost[u])
                for j in members:
                    out[j] = usable[i].name
                continue
            for i, piece in self._pieces(members, queries, fill):
                for j in piece:
                    out[j] = usable[i].name
        return out

    @staticmethod
    def _pieces(members: list[int], queries: Sequence[QueryLoad], fill: _Fill) -> list[tuple[int, list[int]]]:
        """A group larger than any share (or than one cluster's limits) cut into as few pieces as the
        deficits allow: each piece, in the group's order, fills the largest remaining deficit; the rest
        goes whole once it fits in one (or once no deficit is left)."""
        out: list[tuple[int, list[int]]] = []
        rest = list(members)
        while rest:
            need = max(queries[j].total_tokens for j in rest)
            i = fill.best(need)
            if i < 0:  # no cluster fits every row left: the largest goes alone where it fits
                big = max(rest, key=lambda j: queries[j].total_tokens)
                k = fill.best(queries[big].total_tokens)
                if k < 0:
                    raise no_fit(queries[big], fill.usable)
                fill.put(k, queries[big].total_tokens)
                out.append((k, [big]))
                rest.remove(big)
                continue
            room, whole = fill.deficit[i], charged([queries[j] for j in rest])
            if whole <= room or room <= 0:
                fill.put(i, whole)
                out.append((i, rest))
                return out
            size, top, taken = 0.0, 0, 0  # one group: charged = sum(total - prefix) + max(prefix)
            for j in rest:
                q = queries[j]
                grown, deeper = size + q.total_tokens - q.prefix_tokens, max(top, q.prefix_tokens)
                if taken and grown + deeper > room:
                    break
                size, top, taken = grown, deeper, taken + 1
            fill.put(i, size + top)
            out.append((i, rest[:taken]))
            rest = rest[taken:]
        return out

    @staticmethod
    def queue_order(queries: Sequence[QueryLoad]) -> list[int]:
        """Units longest predicted response first (ties: the longer prompt, then input order), a group's
        rows side by side, longest first within it."""

        def key(j: int) -> tuple[float, int]:
            return (-queries[j].predicted_tokens, -queries[j].prompt_tokens)

        out: list[int] = []
        for members in sorted(units(queries), key=lambda u: min(key(j) for j in u)):
            out += sorted(members, key=key)
        return out
