"""What the batch service refuses, and who is asking: typed errors and the caller, known to no front.

The service (:mod:`gateway.batches.service`) raises a :class:`BatchError` of one of five kinds; each
front maps the kind to its own protocol: the gRPC front to a status code
(:mod:`gateway.grpc_api.servicer`), the OpenAI HTTP front to an HTTP status and OpenAI's error body
(:mod:`gateway.http_api.front`). A front also says who calls (:class:`Caller`), by its own
authentication.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import redis

#: the client that sees every batch (the admin token's); no client token may take this name
ADMIN_CLIENT = "admin"
#: the HTTP front's own identity (its key is one for all): it owns the batches made over HTTP. The
#: ``:`` keeps it apart from token clients, whose names cannot hold one.
HTTP_CLIENT = "http:front"
#: the queue store (Redis) is down or slow: every front answers "unavailable, retry later"
REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
#: Redis' answers for a state that passes (a script past its time limit, loading, a failover): retry later too
_PASSING = re.compile(r"(?:^|error: )(BUSY|LOADING|MASTERDOWN|TRYAGAIN|CLUSTERDOWN|READONLY|NOREPLICAS)\b")


def redis_down(e: BaseException) -> bool:
    """Whether ``e`` says the queue store cannot answer now but will (the one rule both fronts answer by:
    gRPC ``UNAVAILABLE``, HTTP 503): a connection error or timeout, or a reply like ``BUSY``."""
    if isinstance(e, REDIS_DOWN):
        return True
    return isinstance(e, redis.exceptions.ResponseError) and bool(_PASSING.search(str(e)))


class BatchError(Exception):
    """A request the batch service refuses; ``str(error)`` says why, for the caller."""


class InvalidRequest(BatchError):
    """The request itself is wrong (a field, a size, a query no cluster could ever take)."""


class NotFound(BatchError):
    """No such batch, or none the caller may see."""


class Conflict(BatchError):
    """The batch id is taken by another submission (or another caller)."""


class QuotaExceeded(BatchError):
    """The caller's cap of queued queries would be passed: retry when some have finished."""


class Unavailable(BatchError):
    """The fleet cannot take the batch now (no cluster active, or none that can take it now): retry."""


@dataclass(frozen=True)
class Caller:
    """Who calls, as the front established it.

    ``owner``: the proven identity a batch is owned by and shown to (a client token's client, the
    HTTP front's own identity; None without authentication). ``client``: whom the per-client cap
    counts (the token's client, else a header's or the peer's address), or None with
    ``client_problem`` saying why the caller's claim is unusable (checked only when the cap is on).
    """

    owner: str | None
    client: str | None = None
    client_problem: str | None = None
