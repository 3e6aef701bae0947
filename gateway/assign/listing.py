"""Read clusters from Redis for the gateway: sane numbers only, and removed clusters out of listings.

A capacity or limit that is negative, NaN or infinite (written by an older gateway, which
did not validate ``AddCluster``, or sent in a heartbeat) is read as 0 ("unknown") with a
warning, so one bad value cannot make every call that assigns or lists clusters fail.
A cluster in state ``removed`` leaves the listing once nothing of it is queued or running.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Collection, Iterable

from workqueue import ClusterInfo, WorkQueue

log = logging.getLogger(__name__)

_NUMBERS = ("capacity_hint_tps", "plan_tps", "measured_tps", "max_query_tokens", "kv_budget_tokens")
_warned: set[tuple[str, str]] = set()


def sane(info: ClusterInfo) -> ClusterInfo:
    """``info`` with every bad capacity or limit read as 0."""
    fixes = {}
    for key in _NUMBERS:
        v = getattr(info, key)
        if not math.isfinite(v) or v < 0:
            fixes[key] = type(v)(0)
            if (info.name, key) not in _warned:
                _warned.add((info.name, key))
                log.warning("cluster %s: ignoring its stored %s %r (read as 0)", info.name, key, v)
    return dataclasses.replace(info, **fixes) if fixes else info


def read_clusters(
    queue: WorkQueue,
    names: Iterable[str] | None = None,
    *,
    listed: bool = False,
    keep: Collection[str] = (),
) -> list[ClusterInfo]:
    """Clusters (all, or ``names``) with sane numbers; ``listed`` drops removed clusters with no work
    left, except those named in ``keep``."""
    infos = [sane(i) for i in queue.clusters(names)]
    if listed:
        infos = [
            i for i in infos if i.state != "removed" or i.queue_length > 0 or i.inflight > 0 or i.name in keep
        ]
    return infos
