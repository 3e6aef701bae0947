"""A script's call as a value, and one round trip for many calls.

The queue's operations build a :class:`ScriptCall` (script, keys, arguments); alone it runs as
one ``EVALSHA`` (:meth:`ScriptCall.run`, loading the script when Redis lacks it). The worker's
tick puts many of them, and plain commands (:class:`Command`), in one pipeline with
:func:`execute`. That pipeline sends ``EVALSHA`` itself instead of redis-py's pipelined
scripts, which ask ``SCRIPT EXISTS`` first: one more round trip each time. When Redis lacks a
script (a restart, a failover), the calls it refused (``NOSCRIPT``: they did not run) are sent
again, in order, once the scripts are loaded: two round trips then, one from then on. The calls
behind a refused one that Redis had (another client may have loaded them again) ran before it,
so no call may rely on an earlier script call of its pipeline having run: the worker's tick
passes its renewals to its claim for that reason (:mod:`workqueue.worker_tick`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError


@dataclass(frozen=True)
class ScriptCall:
    script: Script
    keys: list[str]
    args: list[Any]

    def run(self) -> Any:
        return self.script(keys=self.keys, args=self.args)

    def queue(self, pipe: Any, **options: Any) -> None:
        # execute_command: a Redis Cluster pipeline blocks its evalsha method, not the command
        pipe.execute_command("EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args, **options)


class Command:
    """A plain command for :func:`execute`: ``Command("hget", key, field)``."""

    def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.name, self.args, self.kwargs = name, args, kwargs

    def queue(self, pipe: Any) -> None:
        getattr(pipe, self.name)(*self.args, **self.kwargs)


Op = ScriptCall | Command


def _send(client: redis.Redis, ops: Sequence[Op]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    cluster = isinstance(client, redis.cluster.RedisCluster)
    for op in ops:
        if cluster and isinstance(op, ScriptCall):  # its node named, or the client asks it COMMAND GETKEYS
            op.queue(pipe, target_nodes=client.get_node_from_key(op.keys[0]))
        else:
            op.queue(pipe)
    return list(pipe.execute(raise_on_error=False))


def execute(client: redis.Redis, ops: Sequence[Op]) -> list[Any]:
    """Run ``ops`` in one pipeline (not a transaction: other clients' commands may come between them);
    their replies in order. A command's error is raised after every command ran; a lost connection
    raises at once (some commands may have run: each op must be safe to repeat or to lose)."""
    if not ops:
        return []
    replies = _send(client, ops)
    refused = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
    if refused:
        scripts = {id(ops[i].script): ops[i].script for i in refused if isinstance(ops[i], ScriptCall)}
        for script in scripts.values():
            script.sha = client.script_load(script.script)
        for i, r in zip(refused, _send(client, [ops[i] for i in refused]), strict=True):
            replies[i] = r
    for r in replies:
        if isinstance(r, Exception):
            raise r
    return replies
