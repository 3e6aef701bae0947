"""A per-client cap on queued queries (``max_queued_per_client``).

A client is the one its Bearer token names when the gateway has client tokens
(:mod:`gateway.auth`); else (the HTTP front, a gateway without tokens) its ``x-client-id``
request header, else its address (the host of the gRPC peer). The gateway keeps each client's batch ids in a Redis set; a submission is
refused with ``RESOURCE_EXHAUSTED`` when the client's unfinished queries (total minus
completed, failed and cancelled, over its batches not yet final) plus the new batch's would
exceed the cap. Final or expired batches leave the set as they are seen. A batch submitted with a
client token is that client's: another client's calls on it are ``NOT_FOUND`` (:func:`may_see`). Submissions of one
client are checked one at a time within a gateway, so concurrent batches cannot both slip in.
"""

from __future__ import annotations

import asyncio
import weakref

from gateway.auth import ADMIN_CLIENT
from gateway.validation import id_problem
from workqueue import WorkQueue, keys
from workqueue.keys import PREFIX

CLIENT_HEADER = "x-client-id"


def client_key(client: str) -> str:
    return f"{PREFIX}gw:client:{client}:batches"  # the deployment's hash tag: one slot with the queue


def client_of(metadata: dict[str, str], peer: str) -> str:
    """The client's name: its ``x-client-id`` header, else the host part of ``peer`` (``ipv4:1.2.3.4:5``)."""
    if metadata.get(CLIENT_HEADER):
        return metadata[CLIENT_HEADER]
    host = peer.split(":", 1)[1] if ":" in peer else peer  # drop the ipv4:/ipv6: scheme
    host = host.rsplit(":", 1)[0]  # and the port
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in host)[:128] or "unknown"


def header_problem(metadata: dict[str, str]) -> str | None:
    value = metadata.get(CLIENT_HEADER)
    return id_problem(value, f"{CLIENT_HEADER} header") if value is not None else None


def unfinished(queue: WorkQueue, client: str) -> int:
    """Queries of ``client``'s batches not yet finished; forgets its final and expired batches."""
    key = client_key(client)
    left = 0
    for bid in queue.r.smembers(key):
        info = queue.batch(bid)
        if info is None or info.final:
            queue.r.srem(key, bid)
            continue
        left += max(0, info.total - info.completed - info.failed - info.cancelled)
    return left


def remember(queue: WorkQueue, client: str, batch_id: str) -> None:
    queue.r.sadd(client_key(client), batch_id)


OWNER_FIELD = "owner"  # a field of the batch's hash (workqueue.keys.batch): expires with the batch


def set_owner(queue: WorkQueue, batch_id: str, client: str) -> None:
    """Record the client that submitted a batch (the first one, should two race on its id)."""
    if queue.r.exists(keys.batch(batch_id)):
        queue.r.hsetnx(keys.batch(batch_id), OWNER_FIELD, client)


def may_see(queue: WorkQueue, batch_id: str, client: str | None) -> bool:
    """Whether ``client`` (None: a caller without a client token) may read, stream or cancel the batch:
    its owner and the admin may; a batch of no token-holder (made over HTTP, or before client tokens
    were configured) is open to every caller, as is every batch to callers without tokens (the HTTP
    front, whose key is one for all; a gateway without client tokens)."""
    if client is None or client == ADMIN_CLIENT:
        return True
    return (queue.r.hget(keys.batch(batch_id), OWNER_FIELD) or client) == client


class ClientLocks:
    """One asyncio lock per client name, so a client's submissions are checked one at a time.

    A lock lives while a submission holds or waits for it (weakly kept here), so the table holds
    only the clients submitting now, however many clients have come and gone."""

    def __init__(self) -> None:
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def __call__(self, client: str) -> asyncio.Lock:
        lock = self._locks.get(client)
        if lock is None:
            lock = self._locks[client] = asyncio.Lock()
        return lock

    def __len__(self) -> int:
        return len(self._locks)
