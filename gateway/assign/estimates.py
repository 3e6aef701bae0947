"""What an assignment costs each cluster: tokens per cluster, expected finish times, and the prefix-aware
charge (a prefix group's shared prompt counted once per cluster that runs it, ``docs/design/assign.md``).

Pure module: no Redis, no gRPC, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from gateway.assign.loads import ClusterView, QueryLoad


def charged(queries: Sequence[QueryLoad]) -> float:
    """Prompt + predicted tokens of ``queries`` run on one cluster, each group's shared prefix counted once."""
    total = math.fsum(q.total_tokens - q.prefix_tokens for q in queries)
    best: dict[str, int] = {}
    for q in queries:
        if q.prefix_group is not None:
            best[q.prefix_group] = max(best.get(q.prefix_group, 0), q.prefix_tokens)
    return total + sum(best.values())


def charged_tokens(queries: Sequence[QueryLoad], assignment: Sequence[str]) -> list[float]:
    """Each query's share of :func:`charged` on its cluster, in the order the queries are given (the
    queue order): the first row of a group on a cluster pays its whole prompt, the others their
    prompt less the shared prefix. Sums per cluster to ``charged`` of its queries (for one depth)."""
    if len(assignment) != len(queries):
        raise ValueError(f"{len(queries)} queries but {len(assignment)} assignments")
    seen: set[tuple[str, str]] = set()
    out = []
    for q, c in zip(queries, assignment, strict=True):
        if q.prefix_group is None or (q.prefix_group, c) not in seen:
            out.append(q.total_tokens)
            if q.prefix_group is not None:
                seen.add((q.prefix_group, c))
        else:
            out.append(q.total_tokens - q.prefix_tokens)
    return out


def tokens_per_cluster(
    queries: Sequence[QueryLoad], assignment: Sequence[str], weights: Sequence[float] | None = None
) -> dict[str, float]:
    """Sum of ``total_tokens`` (or of ``weights``, one per query) per assigned cluster name."""
    if len(assignment) != len(queries):
        raise ValueError(f"{len(queries)} queries but {len(assignment)} assignments")
    if weights is not None and len(weights) != len(queries):
        raise ValueError(f"{len(queries)} queries but {len(weights)} weights")
    out: dict[str, float] = {}
    for j, name in enumerate(assignment):
        w = queries[j].total_tokens if weights is None else weights[j]
        out[name] = out.get(name, 0.0) + w
    return out


def finish_times(clusters: Sequence[ClusterView], added: Mapping[str, float]) -> dict[str, float]:
    """Expected finish time ``(pending + added) / capacity`` per cluster (``inf`` with work and no capacity)."""
    out = {}
    for c in clusters:
        work = c.pending_tokens + added.get(c.name, 0.0)
        out[c.name] = work / c.capacity_tps if c.capacity_tps > 0 else (math.inf if work > 0 else 0.0)
    return out
