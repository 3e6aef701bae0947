"""Counting a client's round trips to Redis: what a tick of the worker, the intake or the offloader costs on a WAN.

A round trip is one request sent on a connection and waited for: a command, or a whole
pipeline (its commands go out in one write and their replies come back together). redis-py
sends either with one ``send_packed_command`` call, so :func:`count_round_trips` counts those
calls on every connection the client opens from then on (connection set-up, such as ``HELLO``
and ``SELECT``, included: they cost round trips too). Pub/sub connections opened by
``client.pubsub()`` are counted as well, but a listener mostly waits for pushes, which cost none.
"""

from __future__ import annotations

import threading

import redis


class RoundTrips:
    """A thread-safe count of round trips."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self._n += 1

    @property
    def value(self) -> int:
        return self._n


def _pools(client: redis.Redis | redis.cluster.RedisCluster) -> list[redis.ConnectionPool]:
    if isinstance(client, redis.cluster.RedisCluster):
        return [node.redis_connection.connection_pool for node in client.get_nodes() if node.redis_connection]
    return [client.connection_pool]


def count_round_trips(client: redis.Redis | redis.cluster.RedisCluster) -> RoundTrips:
    """Count the round trips ``client`` makes from now on (its open connections are closed and reopened
    when next used; on a Redis Cluster, those of the nodes known now)."""
    counter = RoundTrips()
    for pool in _pools(client):
        base = pool.connection_class

        def send_packed_command(self, command, check_health=True, _base=base):
            counter.add()
            return _base.send_packed_command(self, command, check_health)

        pool.disconnect()
        pool.connection_class = type(
            f"Counted{base.__name__}", (base,), {"send_packed_command": send_packed_command}
        )
        pool.reset()
    return counter
