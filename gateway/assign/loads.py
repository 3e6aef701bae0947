"""What assignment reasons about: a query's load (:class:`QueryLoad`), a cluster as the assigner sees it
(:class:`ClusterView`), the policy interface (:class:`AssignmentPolicy`), and the one rule of whether a
query fits a cluster (:func:`fitting`, :func:`misfit`). Below the policies and the estimates, which both
build on it (:mod:`gateway.assign.policies`, :mod:`gateway.assign.estimates`). Pure module."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

#: a prompt token's cost as a share of a generated token's, in the fleet's work units ("generated-token
#: equivalents": prefill runs a prompt's tokens in one batched pass, a generated token costs a decode step). The
#: clusters' capacities (plans, heartbeats) count generated tokens a second, so work in these units over a
#: capacity is a time. The one place for this rule: the ETA (:mod:`gateway.status.eta`) and the cost policy's time
#: model (:mod:`gateway.assign.cost`) both read it.
PROMPT_WEIGHT = 0.1


def work(prompt_tokens: float, generated_tokens: float) -> float:
    """Generated-token equivalents of a prompt and its answer (:data:`PROMPT_WEIGHT`)."""
    return generated_tokens + PROMPT_WEIGHT * prompt_tokens


def work_units(prompt_share: float) -> float:
    """Generated-token equivalents of one token of a mix with this prompt share (:data:`PROMPT_WEIGHT`)."""
    return 1.0 - prompt_share * (1.0 - PROMPT_WEIGHT)


def work_per_token(queries: Sequence[QueryLoad]) -> float:
    """Work units a token of these queries is worth (their work over their tokens; 1 for none, or all empty)."""
    tokens = math.fsum(q.total_tokens for q in queries)
    units = math.fsum(q.work_tokens for q in queries)
    return units / tokens if tokens > 0 and units > 0 else 1.0


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

    @property
    def work_tokens(self) -> float:
        """The query's time on a cluster in generated-token equivalents: its predicted response plus its prompt
        at :data:`PROMPT_WEIGHT`."""
        return work(self.prompt_tokens, self.predicted_tokens)


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


def usable_clusters(clusters: Sequence[ClusterView]) -> list[ClusterView]:
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


def no_fit(q: QueryLoad, clusters: Sequence[ClusterView]) -> NoClusterError:
    return NoClusterError(misfit(q, clusters) or f"query {q.key!r} fits no cluster")
