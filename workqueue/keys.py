"""The Redis key schema. No other module spells a key name: the Lua scripts get theirs from here.

Keys (prefix ``{fb}:``)::

    {fb}:clusters                 SET   names of registered clusters
    {fb}:c:{cluster}:info         HASH  static config: capacity hint, plan tokens/s, backend, state, limits,
                                        notice_until (:data:`NOTICE_UNTIL`: the end of a preemption notice)
    {fb}:c:{cluster}:hb           HASH  last heartbeat (expires: alive = exists)
    {fb}:c:{cluster}:queue        ZSET  query ids waiting, scored by their rank (workqueue.ordering): lowest runs next
    {fb}:c:{cluster}:inflight     ZSET  query ids taken by a worker, scored by lease deadline
    {fb}:c:{cluster}:pending      STR   predicted tokens (prompt + response) of the queued queries
    {fb}:c:{cluster}:stats        HASH  assigned/finished counters (predicted and actual tokens)
    {fb}:c:{cluster}:wake         CHANNEL pub/sub: published when queries land in the queue (wakes idle engines)
    {fb}:q:{gid}                  HASH  one query: payload JSON, cluster, state, attempts, rank, times,
                                        tokens (its charge on its cluster: prompt + predicted response less
                                        the prompt tokens that cluster's prefix cache is expected to hold),
                                        full_tokens (:data:`FULL_TOKENS`: prompt + predicted response, no
                                        discount: what fit checks and a move's recipient use),
                                        partial (:data:`PARTIAL`: the output a checkpoint saved, JSON)
    {fb}:w:{gid}                  HASH  id: the write that recorded the query's result (expires: a resend is told apart)
    {fb}:batches                  ZSET  batch ids by creation time
    {fb}:deadlines                ZSET  unfinished batches with a deadline, by deadline (gateway clock)
    {fb}:seq                      STR   the enqueue sequence: each query's place in the order (its rank's tail)
    {fb}:b:{batch}                HASH  batch status, request counts, deadline, order key, token progress
    {fb}:b:{batch}:results        LIST  finished-query result JSON, in completion order
    {fb}:b:{batch}:done           SET   query ids with a result (makes results write-once)
    {fb}:observed                 LIST  observed (prompt, length) records for predictor retraining
    {fb}:lengths:{model}          HASH  a length model's observed vs predicted answer lengths, by range
                                        (workqueue.length_stats: n:<i>, p:<i>, o:<i>)
    {fb}:mover                    STR   the mover lease: who may move queued work now (expires)
    {fb}:intake                   ZSET  batch ids whose background intake is unfinished, by acceptance time
    {fb}:b:{batch}:intake         LIST  the batch's accepted rows not yet enqueued (JSON, in submission order)
    {fb}:b:{batch}:intake-lease   STR   the intake lease: who enqueues the batch's rows now (expires)
    {fb}:b:{batch}:staging:{tok}  LIST  rows of one submission being stored, before its batch exists (expires)

Keys of the gateway (its HTTP front and its per-client quota)::

    {fb}:gw:client:{client}:batches  SET   a client's batch ids (the quota's count)
    {fb}:oai:batches              ZSET  ids of batches created over HTTP, by creation time
    {fb}:oai:finalize             SET   ids of HTTP batches whose output files are not written yet
    {fb}:oai:expire               ZSET  ``b:<batch id>`` and ``f:<file id>`` by the time their retention ends
    {fb}:oai:b:{batch}            HASH  an HTTP batch's record (input file, endpoint, output files, usage)
    {fb}:oai:b:{batch}:lease      STR   the finalizer lease: which gateway writes the batch's files now (expires)
    {fb}:oai:fdel:{file}          STR   counter: the file is being deleted (expires)

A lease (``mover``, ``intake-lease``, the finalizer's) is taken, renewed and given back only
through :mod:`workqueue.lease`.

A query's global id ``gid`` is ``{batch_id}:{query_id}``; batch ids never contain ``:``.

**Redis Cluster.** ``{fb}`` is a hash tag: every key of a deployment hashes to one slot, so
the scripts and transactions that touch several keys stay atomic on a Redis Cluster too
(the queue is one consistency domain, served by one shard and its replicas). Scripts get the
keys they know up front as ``KEYS`` (which routes them to that shard); the ones they find on
the way (a popped query id's hash, its batch) are built in Lua by functions generated here
from the same templates (:func:`lua_functions`).
"""

from __future__ import annotations

TAG = "{fb}"
PREFIX = TAG + ":"

#: name -> template of the key, ``%s`` standing for the one variable part
TEMPLATES = {
    "cluster_info": "c:%s:info",
    "heartbeat": "c:%s:hb",
    "queue": "c:%s:queue",
    "inflight": "c:%s:inflight",
    "pending": "c:%s:pending",
    "cluster_stats": "c:%s:stats",
    "wake": "c:%s:wake",
    "query": "q:%s",
    "batch": "b:%s",
    "results": "b:%s:results",
    "done": "b:%s:done",
}

CLUSTERS = PREFIX + "clusters"
BATCHES = PREFIX + "batches"
DEADLINES = PREFIX + "deadlines"
SEQ = PREFIX + "seq"
OBSERVED = PREFIX + "observed"
MOVER = PREFIX + "mover"
INTAKE = PREFIX + "intake"
OAI_BATCHES = PREFIX + "oai:batches"
OAI_FINALIZE = PREFIX + "oai:finalize"
OAI_EXPIRE = PREFIX + "oai:expire"
#: the glob of every key and pub/sub channel of a deployment (a Redis ACL user's ``~`` and ``&`` patterns)
EVERY_KEY = PREFIX + "*"

#: the field of a query's hash that holds its full size (prompt + predicted response, no prefix discount) beside
#: its charged ``tokens``; a row written before it existed has none and counts its ``tokens`` (Lua: ``F_FULL_TOKENS``)
FULL_TOKENS = "full_tokens"

#: the field of a query's hash that holds its partial output (:class:`workqueue.partial.Partial`, JSON): the tokens a
#: preempted or checkpointed run generated, resumed by the next claim; it goes with the hash when the result is
#: written (Lua: ``F_PARTIAL``)
PARTIAL = "partial"
#: the field of a cluster's hash that holds the end of its preemption notice (Redis time, seconds): from the notice
#: on the cluster claims nothing (Lua: ``F_NOTICE_UNTIL``); making it active again deletes the field
NOTICE_UNTIL = "notice_until"


def _key(name: str, part: str) -> str:
    return PREFIX + TEMPLATES[name] % part


def cluster_info(name: str) -> str:
    return _key("cluster_info", name)


def wake(name: str) -> str:
    """The pub/sub channel announcing new queries in ``name``'s queue (not a key: nothing is stored)."""
    return _key("wake", name)


def heartbeat(name: str) -> str:
    return _key("heartbeat", name)


def queue(name: str) -> str:
    return _key("queue", name)


def inflight(name: str) -> str:
    return _key("inflight", name)


def pending(name: str) -> str:
    return _key("pending", name)


def cluster_stats(name: str) -> str:
    return _key("cluster_stats", name)


def query(gid: str) -> str:
    return _key("query", gid)


def batch(batch_id: str) -> str:
    return _key("batch", batch_id)


def results(batch_id: str) -> str:
    return _key("results", batch_id)


def done(batch_id: str) -> str:
    return _key("done", batch_id)


def intake(batch_id: str) -> str:
    return batch(batch_id) + ":intake"


def intake_lease(batch_id: str) -> str:
    return batch(batch_id) + ":intake-lease"


def observed_call(call: str) -> str:
    """A write of observed lengths, marked a short while under its call's id: the same call resent adds nothing."""
    return OBSERVED + ":call:" + call


def length_stats(model: str) -> str:
    """A length model's (a served model's) observed vs predicted answer lengths (:mod:`workqueue.length_stats`)."""
    return f"{PREFIX}lengths:{model}"


def result_write(gid: str) -> str:
    """The id of the write that recorded a query's result, kept a short while: the same write resent is told
    from a second run's (``workqueue.scripts.RESENT``)."""
    return f"{PREFIX}w:{gid}"


def claim_reply(cluster: str, call: str) -> str:
    """A CLAIM's reply, kept a short while under its call's id: the same call resent answers it again."""
    return cluster_info(cluster) + ":claim:" + call


def staging(batch_id: str, token: str) -> str:
    return batch(batch_id) + ":staging:" + token


def client_batches(client: str) -> str:
    return f"{PREFIX}gw:client:{client}:batches"


def oai_record(batch_id: str) -> str:
    return f"{PREFIX}oai:b:{batch_id}"


def oai_finalize_lease(batch_id: str) -> str:
    return oai_record(batch_id) + ":lease"


def oai_deleting(file_id: str) -> str:
    return f"{PREFIX}oai:fdel:{file_id}"


def gid(batch_id: str, query_id: str) -> str:
    return f"{batch_id}:{query_id}"


def split_gid(g: str) -> tuple[str, str]:
    batch_id, _, query_id = g.partition(":")
    return batch_id, query_id


def lua_functions() -> str:
    """``local function k_<name>(x) ... end`` for every template, and ``K_DEADLINES``, ``K_SEQ``: the scripts'
    key builders and the fixed keys they meet on the way; ``F_FULL_TOKENS``, ``F_PARTIAL``, ``F_NOTICE_UNTIL``: the
    fields :data:`FULL_TOKENS`, :data:`PARTIAL`, :data:`NOTICE_UNTIL`."""
    lines = []
    for name, template in TEMPLATES.items():
        head, tail = (PREFIX + template).split("%s")
        lines.append(f"local function k_{name}(x) return '{head}' .. x .. '{tail}' end")
    lines += [
        f"local K_DEADLINES = '{DEADLINES}'",
        f"local K_SEQ = '{SEQ}'",
        f"local F_FULL_TOKENS = '{FULL_TOKENS}'",
        f"local F_PARTIAL = '{PARTIAL}'",
        f"local F_NOTICE_UNTIL = '{NOTICE_UNTIL}'",
    ]
    return "\n".join(lines) + "\n"
