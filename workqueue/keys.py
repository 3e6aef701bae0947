"""The Redis key schema. No other module builds key strings.

Keys (prefix ``fb:``)::

    fb:clusters                 SET   names of registered clusters
    fb:c:{cluster}:info         HASH  static config: capacity hint, plan tokens/s, backend, state, limits
    fb:c:{cluster}:hb           HASH  last heartbeat (expires: alive = exists)
    fb:c:{cluster}:queue        LIST  query ids waiting, head = next to run, tail = newest
    fb:c:{cluster}:inflight     ZSET  query ids taken by a worker, scored by lease deadline
    fb:c:{cluster}:pending      STR   predicted tokens (prompt + response) of the queued queries
    fb:c:{cluster}:stats        HASH  assigned/finished counters (predicted and actual tokens)
    fb:q:{gid}                  HASH  one query: payload JSON, cluster, state, attempts, times
    fb:batches                  ZSET  batch ids by creation time
    fb:b:{batch}                HASH  batch status and request counts
    fb:b:{batch}:results        LIST  finished-query result JSON, in completion order
    fb:b:{batch}:done           SET   query ids with a result (makes results write-once)
    fb:observed                 LIST  observed (prompt, length) records for predictor retraining
    fb:mover                    STR   the mover lease: who may move queued work now (expires)

A query's global id ``gid`` is ``{batch_id}:{query_id}``; batch ids never contain ``:``.
"""

from __future__ import annotations

PREFIX = "fb:"
CLUSTERS = PREFIX + "clusters"
BATCHES = PREFIX + "batches"
OBSERVED = PREFIX + "observed"
MOVER = PREFIX + "mover"


def cluster_info(name: str) -> str:
    return f"{PREFIX}c:{name}:info"


def heartbeat(name: str) -> str:
    return f"{PREFIX}c:{name}:hb"


def queue(name: str) -> str:
    return f"{PREFIX}c:{name}:queue"


def inflight(name: str) -> str:
    return f"{PREFIX}c:{name}:inflight"


def pending(name: str) -> str:
    return f"{PREFIX}c:{name}:pending"


def cluster_stats(name: str) -> str:
    return f"{PREFIX}c:{name}:stats"


def query(gid: str) -> str:
    return f"{PREFIX}q:{gid}"


def batch(batch_id: str) -> str:
    return f"{PREFIX}b:{batch_id}"


def results(batch_id: str) -> str:
    return f"{PREFIX}b:{batch_id}:results"


def done(batch_id: str) -> str:
    return f"{PREFIX}b:{batch_id}:done"


def gid(batch_id: str, query_id: str) -> str:
    return f"{batch_id}:{query_id}"


def split_gid(g: str) -> tuple[str, str]:
    batch_id, _, query_id = g.partition(":")
    return batch_id, query_id
