"""A Redis connection that loses a reply after Redis ran the command: redis-py then sends the call again, as it
does when a reset or a stall past the reply timeout eats a reply on a real network (as many times as the
project's clients retry, :data:`workqueue.embedded.RETRIES`)."""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.connection import UnixDomainSocketConnection
from redis.retry import Retry

from workqueue.embedded import RETRIES


class LosingConnection(UnixDomainSocketConnection):
    """Loses the reply to the first ``losses`` calls whose packed command contains ``marker``."""

    marker: bytes = b""
    losses: int = 1
    lost: int = 0

    def send_packed_command(self, command, check_health: bool = True) -> None:
        parts = command if isinstance(command, list) else [command]
        self._armed = any(self.marker in bytes(p) for p in parts) and type(self).lost < type(self).losses
        super().send_packed_command(command, check_health)

    def read_response(self, *args, **kwargs):
        reply = super().read_response(*args, **kwargs)
        if getattr(self, "_armed", False):
            self._armed = False
            type(self).lost += 1
            self.disconnect()
            raise redis.ConnectionError("reply lost (test)")
        return reply


def losing_client(
    socket_file: str, marker: bytes, losses: int = 1
) -> tuple[redis.Redis, type[LosingConnection]]:
    """A client of the Redis at ``socket_file`` that loses the replies of ``losses`` calls naming ``marker``."""
    cls = type("Losing", (LosingConnection,), {"marker": marker, "losses": losses, "lost": 0})
    pool = redis.ConnectionPool(
        connection_class=cls, path=socket_file, decode_responses=True, retry=Retry(NoBackoff(), RETRIES)
    )
    return redis.Redis(connection_pool=pool), cls
