"""The Redis queue layer shared by the gateway and the engine workers.

One place for the key schema (:mod:`workqueue.keys`), the Lua scripts that make every
multi-key change atomic (:mod:`workqueue.scripts`; their shared functions from one source,
:mod:`workqueue.lua` and :mod:`workqueue.lua_queue`), the one lease primitive (:mod:`workqueue.lease`), the typed queue API
(:mod:`workqueue.queue`: :class:`WorkQueue`, composed of parts that share a
:class:`workqueue.core.QueueCore`: clusters and heartbeats in :mod:`workqueue.clusters`, claims
and leases in :mod:`workqueue.leases`, batches in :mod:`workqueue.batches`, background intake in
:mod:`workqueue.intake_ops`, queue reads and moves in :mod:`workqueue.moves`, many clusters or
batches per round trip in :mod:`workqueue.ticks`; the mover lease in :mod:`workqueue.mover`, the
records in :mod:`workqueue.records`, a query's partial output in :mod:`workqueue.partial`), the embedded Redis server used when no URL is given and the
one place every client is made (:mod:`workqueue.embedded`; TLS in :mod:`workqueue.redis_tls`), and
the ACL rules of each role, what a worker and a gateway may run (:mod:`workqueue.acl`). The gateway
and the engines meet only here and in the protos.
"""

from workqueue.embedded import EmbeddedRedis, connect, resolve_url
from workqueue.intake_ops import StagedRowsMissing
from workqueue.queue import WorkQueue
from workqueue.records import (
    BatchInfo,
    BatchState,
    ClaimedQuery,
    ClusterInfo,
    Observation,
    Outcome,
    QueryResult,
    QueryState,
    QueuedQuery,
    outcome,
)

__all__ = [
    "BatchInfo",
    "BatchState",
    "ClaimedQuery",
    "ClusterInfo",
    "EmbeddedRedis",
    "Observation",
    "Outcome",
    "QueryResult",
    "QueryState",
    "QueuedQuery",
    "StagedRowsMissing",
    "WorkQueue",
    "connect",
    "outcome",
    "resolve_url",
]
