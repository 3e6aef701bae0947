"""The Redis ACL rules of each role: the one place that lists what a worker and a gateway may run.

An engine in another cloud connects to the home Redis as an ACL user of its own (one per cloud), allowed
only the commands a worker sends and only the deployment's keys and channels (``{fb}:*``, see
:mod:`workqueue.keys`). Redis 7 checks every command a Lua script calls, and every key it touches,
against the user that runs the script, so a role's commands include those its scripts call
(:data:`SCRIPT_COMMANDS`, which ``tests/test_redis_tls.py`` checks against the scripts' source).
Whatever is not listed is refused with ``NOPERM``: ``FLUSHALL``, ``CONFIG``, ``SHUTDOWN``, ``KEYS``,
``SCAN``, ``DEBUG``, ``ACL``, ``SCRIPT FLUSH``, ``MONITOR``, any key outside ``{fb}:*``.

``fleetbatch gateway redis-acl --user NAME --role worker|gateway`` prints a user's line for the
server's ACL file (:func:`acl_line`), its password only as its SHA-256.
"""

from __future__ import annotations

import hashlib

from workqueue.keys import EVERY_KEY

#: what every client sends when it connects (redis-py: ``HELLO``; ``SELECT`` for a db other than 0), checks
#: the link with, and runs scripts with (``EVALSHA``, loading them on ``NOSCRIPT``). Not ``CLIENT SETINFO``:
#: Redis 7.0 does not know it, so an ACL file naming it would not load there; redis-py ignores its refusal.
CONNECTION_COMMANDS = (
    "auth",
    "hello",
    "ping",
    "select",
    "client|setname",
    "client|getname",
    "client|id",
    "evalsha",
    "script|load",
    "script|exists",
    # a Redis Cluster client (``redis+cluster://``) also reads the slot map and the command table, and follows
    # a slot being migrated (``ASK``)
    "cluster|slots",
    "cluster|shards",
    "command",
    "asking",
)

#: every command the queue's Lua scripts call (``redis.call``/``redis.pcall``)
SCRIPT_COMMANDS = (
    "del",
    "exists",
    "expire",
    "pexpire",
    "get",
    "set",
    "incrby",
    "incrbyfloat",
    "type",
    "time",
    "hget",
    "hmget",
    "hgetall",
    "hset",
    "hsetnx",
    "hexists",
    "hincrby",
    "hincrbyfloat",
    "lrange",
    "llen",
    "rpush",
    "ltrim",
    "sadd",
    "smembers",
    "zadd",
    "zrem",
    "zrange",
    "zrangebyscore",
    "zscore",
    "zrevrank",
    "zpopmin",
    "zpopmax",
)

#: what an engine's worker sends outside scripts: heartbeats, registration, reads, the wake channel
WORKER_COMMANDS = (
    "zcard",
    "subscribe",
    "unsubscribe",
    "multi",
    "exec",
    "discard",
)

#: what the gateway sends outside scripts besides the worker's (its HTTP front's records and leases,
#: the quota, the mover's and intake's transactions, the wake notices)
GATEWAY_COMMANDS = (
    "eval",  # the gateway's own small scripts (set_once, the finalizer's and retention's); a worker runs only
    # the queue's, by EVALSHA: a leaked worker password cannot run a script of its own
    "script|kill",  # stops a script that runs away (Redis answers BUSY meanwhile), with `user default off`
    "watch",
    "unwatch",
    "publish",
    "rename",
    "persist",
    "pttl",
    "ttl",
    "incr",
    "decr",
    "decrby",  # redis-py's decr()
    "hdel",
    "srem",
    "scard",
    "sismember",
    "lindex",
    "zcount",
    "zrevrange",
)

ROLES = {
    "worker": CONNECTION_COMMANDS + SCRIPT_COMMANDS + WORKER_COMMANDS,
    "gateway": CONNECTION_COMMANDS + SCRIPT_COMMANDS + WORKER_COMMANDS + GATEWAY_COMMANDS,
}

#: the keys and the pub/sub channels of a deployment (every name starts with the ``{fb}`` hash tag)
KEY_PATTERN = EVERY_KEY


def password_hash(password: str) -> str:
    """The ACL file's ``#<sha256>`` form of ``password`` (Redis never needs it in clear)."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def acl_rules(role: str) -> list[str]:
    """The rules of ``role`` after the password: its keys, its channels, its commands (nothing else)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    return ["resetchannels", f"~{KEY_PATTERN}", f"&{KEY_PATTERN}", "-@all", *(f"+{c}" for c in ROLES[role])]


def acl_line(user: str, role: str, password: str) -> str:
    """The ACL file's line for ``user`` in ``role`` (``user NAME reset on #<sha256> ~{fb}:* &{fb}:* -@all +...``)."""
    if not user or any(c.isspace() for c in user):
        raise ValueError(f"an ACL user name has no spaces and is not empty, not {user!r}")
    if not password:
        raise ValueError("the password is empty")
    return " ".join(["user", user, "reset", "on", password_hash(password), *acl_rules(role)])
