"""Where the queries of a chunk can go: now, later, or never.

Three answers, each with its own treatment:

* **now**: a cluster that accepts work (:func:`gateway.assign.views.cluster_views`: active and alive,
  or never seen alive while none is) takes the query; the policy assigns these together.
* **never**: the query is over the per-query limit of every *configured* cluster (every
  cluster in state ``active``, alive or not). That is permanent: the intake fails the row at
  once and the synchronous path answers ``INVALID_ARGUMENT``, each naming the limit.
* **later**: some configured cluster could take the query, but none of them accepts work now
  (an engine restarting or loading its model sends no heartbeat). That is transient: the
  intake waits for it, bounded (``fleetbatch gateway serve --intake-wait-s``, :data:`gateway.config.INTAKE_WAIT_S`
  by default), and fails the row only after the bound; the synchronous path answers the
  retryable ``UNAVAILABLE``.

A cluster's limits come from its configuration and, while it is alive, its heartbeats; a
configured cluster whose limit is unknown may take any query.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.assign.listing import read_clusters
from gateway.assign.policies import ClusterView, QueryLoad, fitting, misfit
from gateway.assign.views import cluster_views
from workqueue import ClusterInfo, WorkQueue

log = logging.getLogger(__name__)

Assign = Callable[[Sequence[QueryLoad], list[ClusterView]], list[str]]


class IntakeWaits(Exception):
    """A chunk has rows that only a cluster that is not alive now could take: the batch waits."""


@dataclass(frozen=True)
class Placement:
    """A chunk's answer, index for index: the cluster of each query placed now (None otherwise),
    the permanent misfits with their reason, and the indexes that wait for a cluster."""

    names: list[str | None]
    never: dict[int, str]
    later: list[int]


def configured_views(infos: Sequence[ClusterInfo]) -> list[ClusterView]:
    """Every active cluster, alive or not, as a view (what could take work once alive)."""
    views = cluster_views(infos)
    return [
        dataclasses.replace(v, accepting=True)
        for i, v in zip(infos, views, strict=True)
        if i.state == "active"
    ]


def first_misfit(loads: Sequence[QueryLoad], infos: Sequence[ClusterInfo]) -> str | None:
    """The reason of the first query that fits no configured cluster (None: every one may fit)."""
    configured = configured_views(infos)
    return next((why for why in (misfit(q, configured, "configured") for q in loads) if why), None)


def place(loads: Sequence[QueryLoad], infos: Sequence[ClusterInfo], assign: Assign) -> Placement:
    """Sort ``loads`` into now / never / later (module docstring) and assign the first kind."""
    views = cluster_views(infos)
    live = [v for v in views if v.usable]
    configured = configured_views(infos)
    never: dict[int, str] = {}
    later: list[int] = []
    now: list[int] = []
    if loads and live and max(q.total_tokens for q in loads) <= min(v.query_limit for v in live):
        now = list(range(len(loads)))  # each fits every live cluster, so a configured one: the rule agrees
    else:
        for i, load in enumerate(loads):
            why = misfit(load, configured, "configured")
            if why is not None:
                never[i] = why
            elif fitting(load, live):
                now.append(i)
            else:
                later.append(i)
    names: list[str | None] = [None] * len(loads)
    if now:
        for i, name in zip(now, assign([loads[i] for i in now], views), strict=True):
            names[i] = name
    return Placement(names, never, later)


def place_or_wait(
    queue: WorkQueue, batch_id: str, loads: Sequence[QueryLoad], assign: Assign, wait_s: float
) -> dict[str, tuple[str | None, str]]:
    """A chunk of background intake placed: per query ``(cluster, "")`` or ``(None, why it fails)``.
    Raises :class:`IntakeWaits` while some query fits only a cluster that accepts no work now
    and the batch has waited less than ``wait_s`` (since when: in the batch, on the queue's clock)."""
    if not loads:
        return {}
    p = place(loads, read_clusters(queue), assign)
    errors = dict(p.never)
    if p.later:
        now = queue.clock()
        since = queue.intake_wait(batch_id)
        waited = now - since if since is not None else 0.0
        if waited < wait_s:
            if since is not None and since >= now:  # the wait begins: said once, not every poll
                log.warning("batch %s: %s", batch_id, waiting_message(len(p.later), 0.0))
            raise IntakeWaits(waiting_message(len(p.later), waited))
        log.warning(
            "batch %s: %d queries waited %.0f s for a cluster; failing them", batch_id, len(p.later), waited
        )
        errors |= dict.fromkeys(p.later, gave_up(wait_s))
    else:
        queue.intake_waited(batch_id)
    return {load.key: (p.names[i], errors.get(i, "")) for i, load in enumerate(loads)}


def waiting_message(n: int, waited_s: float) -> str:
    """The log line of a chunk whose ``n`` rows wait for a cluster."""
    return (
        f"{n} queries fit only clusters that accept no work now (not alive: restarting or loading); "
        f"waiting for one ({waited_s:.0f} s so far)"
    )


def gave_up(wait_s: float) -> str:
    """The error of a row that waited the whole bound for a cluster."""
    return (
        f"no cluster that can take this query accepted work within {wait_s:g} s "
        "(every one that fits was not alive; gateway --intake-wait-s)"
    )
