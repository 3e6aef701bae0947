"""Waking idle engines when work lands in their queue.

An engine with nothing to run used to poll its queue with a back-off of up to half a second, so
a batch landing on an idle fleet waited that long before its first step. Whatever puts queries
in a cluster's queue (a new batch, the background intake, the mover) now publishes on the
cluster's ``wake`` channel (:func:`workqueue.keys.wake`), and an idle worker blocks on it with
:class:`WakeListener` instead of sleeping. The poll stays as the fallback: a lost message, a path
that does not publish (a lapsed lease put back, a query given back) or a Redis error only costs
the old back-off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import redis

from workqueue import keys

log = logging.getLogger(__name__)


def announce(client: redis.Redis, clusters: Iterable[str]) -> None:
    """Publish a wake message for each of ``clusters``, after the queries are in their queues.

    All in one pipeline (one round trip); one call per cluster on a Redis Cluster client, which
    refuses PUBLISH in pipelines. A failed announcement (Redis gone, PUBLISH denied) only costs
    the engines their poll back-off, never the caller its batch: the queries are already queued.
    """
    names = sorted({c for c in clusters if c})
    if not names:
        return
    try:
        if isinstance(client, redis.cluster.RedisCluster):
            for c in names:
                client.publish(keys.wake(c), "1")
            return
        pipe = client.pipeline(transaction=False)
        for c in names:
            pipe.publish(keys.wake(c), "1")
        pipe.execute()
    except (redis.RedisError, OSError) as e:
        log.debug("could not announce work for %s (%s); its engines will poll", ", ".join(names), e)


class WakeListener:
    """One worker's subscription to its cluster's wake channel.

    ``wait(timeout_s)`` returns True as soon as work is announced, False after ``timeout_s``
    without any. Messages published while the worker was busy are still buffered: they end the
    next wait at once, all together, and the worker asks the queue once more than it needed to.
    """

    def __init__(self, client: redis.Redis, cluster: str) -> None:
        self.client = client
        self.channel = keys.wake(cluster)
        self._pubsub = None
        try:  # subscribed from the start: work announced before the first wait is not missed
            self._subscribe()
        except (redis.RedisError, OSError) as e:
            log.debug("wake channel unavailable (%s); polling", e)
            self.close()

    def _subscribe(self) -> None:
        if self._pubsub is None:
            self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            self._pubsub.subscribe(self.channel)

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        try:
            self._subscribe()
            while (left := deadline - time.monotonic()) > 0:
                if self._pubsub.get_message(timeout=left) is not None:
                    while self._pubsub.get_message(timeout=0) is not None:
                        pass  # one wake-up for everything announced meanwhile
                    return True
        except (redis.RedisError, OSError) as e:
            log.debug("wake channel unavailable (%s); polling", e)
            self.close()
            time.sleep(max(0.0, deadline - time.monotonic()))
        return False

    def close(self) -> None:
        if self._pubsub is not None:
            try:
                self._pubsub.close()
            except (redis.RedisError, OSError):
                pass
            self._pubsub = None
