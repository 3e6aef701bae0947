"""A per-client cap on queued queries (``max_queued_per_client``), and who owns a batch.

A client is the one its Bearer token names when the gateway has client tokens
(:mod:`gateway.grpc_api.auth`); else (the HTTP front, a gateway without tokens) ``hdr:`` and its
``x-client-id`` request header, else ``ip:`` and its address (the host of the gRPC peer). The
prefix keeps what no token proves apart from token clients (whose names hold no ``:``), so a header
``x-client-id: alice`` never spends the token client alice's cap. The gateway keeps each client's
batch ids in a Redis set; a submission is refused with ``RESOURCE_EXHAUSTED`` when the client's
unfinished queries (total minus completed, failed and cancelled, over its batches not yet final)
plus the new batch's would exceed the cap. Final or expired batches leave the set as they are
seen. Submissions of one client are checked one at a time within a gateway, so concurrent
batches cannot both slip in.

**Owners.** A batch submitted by a proven caller (a token client, or the HTTP front: the
``owner`` of the :class:`gateway.batches.errors.Caller` each front's ``caller_of`` makes) is that caller's: its owner and its place in the
client's set are written in the transaction that creates it (:func:`creation_writes`), so no
batch is left without one. Another caller's calls on it are ``NOT_FOUND``, its resubmissions
``ALREADY_EXISTS`` (:func:`may_see`, :func:`may_resubmit`); the admin sees every batch. A batch
without an owner (made by older code, or on a gateway without client tokens) is open to every
caller until a proven caller resubmits it: the first one to do so owns it (``HSETNX``).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from gateway.batches.errors import ADMIN_CLIENT, Caller, InvalidRequest, QuotaExceeded
from gateway.checks.validation import id_problem
from workqueue import WorkQueue, keys
from workqueue.set_once import set_once

CLIENT_HEADER = "x-client-id"


def client_key(client: str) -> str:
    return keys.client_batches(client)  # the deployment's hash tag: one slot with the queue


def client_of(metadata: dict[str, str], peer: str) -> str:
    """The name of a client no token proves: ``hdr:`` and its ``x-client-id`` header, else ``ip:`` and
    the host part of ``peer`` (``ipv4:1.2.3.4:5``)."""
    if metadata.get(CLIENT_HEADER):
        return "hdr:" + metadata[CLIENT_HEADER]
    host = peer.split(":", 1)[1] if ":" in peer else peer  # drop the ipv4:/ipv6: scheme
    host = host.rsplit(":", 1)[0]  # and the port
    return "ip:" + ("".join(c if c.isalnum() or c in "._-" else "_" for c in host)[:128] or "unknown")


def header_problem(metadata: dict[str, str]) -> str | None:
    value = metadata.get(CLIENT_HEADER)
    return id_problem(value, f"{CLIENT_HEADER} header") if value is not None else None


def unproven_caller(owner: str | None, metadata: dict[str, str], peer: str) -> Caller:
    """A caller whose quota client no token proves: ``owner``, counted by its ``x-client-id`` header
    (:func:`client_of`) or its address; a bad header is the caller's problem, told only when the
    cap is on. Both fronts use it (the gRPC one without client tokens, the HTTP one always)."""
    problem = header_problem(metadata)
    if problem:
        return Caller(owner, None, problem)
    return Caller(owner, client_of(metadata, peer))


def unfinished(queue: WorkQueue, client: str) -> int:
    """Queries of ``client``'s batches not yet finished; forgets its final and expired batches."""
    key = client_key(client)
    left, gone = 0, []
    for bid, (info, _) in queue.batches(queue.r.smembers(key)).items():  # one round trip for them all
        if info is None or info.final:
            gone.append(bid)
            continue
        left += max(0, info.total - info.completed - info.failed - info.cancelled)
    if gone:
        queue.r.srem(key, *gone)
    return left


OWNER_FIELD = "owner"  # a field of the batch's hash (workqueue.keys.batch): expires with the batch


def creation_writes(batch_id: str, owner: str | None, client: str | None) -> Callable[[Any], None]:
    """The writes that go in the transaction creating the batch (``extra`` of
    :meth:`workqueue.WorkQueue.create_batch`): its ``owner`` and its place in ``client``'s set (each
    when given)."""

    def write(pipe) -> None:
        if owner:
            pipe.hset(keys.batch(batch_id), OWNER_FIELD, owner)
        if client:
            pipe.sadd(client_key(client), batch_id)

    return write


def may_see(queue: WorkQueue, batch_id: str, client: str | None) -> bool:
    """Whether ``client`` (None: a caller without a client token) may read, stream or cancel the batch:
    its owner and the admin may; a batch without an owner is open to every caller, as is every
    batch to callers without tokens (a gateway without client tokens)."""
    if client is None or client == ADMIN_CLIENT:
        return True
    return owner_allows(queue.r.hget(keys.batch(batch_id), OWNER_FIELD), client)


def owner_allows(owner: str | None, client: str | None) -> bool:
    """Whether a batch whose owner is ``owner`` (None: none) is open to ``client`` (see :func:`may_see`)."""
    return client is None or client == ADMIN_CLIENT or (owner or client) == client


def may_resubmit(queue: WorkQueue, batch_id: str, client: str | None) -> bool:
    """Whether ``client`` may have the existing batch back for a resubmission of it: as
    :func:`may_see`, but a proven client (not the admin) takes a batch without an owner, atomically."""
    if client is None or client == ADMIN_CLIENT:
        return True
    owner = set_once(queue.r, keys.batch(batch_id), OWNER_FIELD, client, present="status")
    return owner in (None, client)  # None: the batch expired meanwhile


T = TypeVar("T")


async def within_quota(
    queue: WorkQueue,
    locks: ClientLocks,
    cap: int,
    caller: Caller,
    batch_id: str,
    count: int,
    create: Callable[[Callable[[Any], None]], Awaitable[T]],
    refused: Callable[[], object] = lambda: None,
) -> T:
    """``create(writes)`` when the caller's client may queue ``count`` more queries under ``cap`` (0: no
    cap), one submission of a client at a time; ``writes`` puts the batch in its client's set and names its
    owner, in the transaction that creates it. ``QuotaExceeded`` (after ``refused()``) otherwise."""
    owner = caller.owner
    if cap <= 0:
        return await create(creation_writes(batch_id, owner, None))
    if caller.client is None:
        raise InvalidRequest(caller.client_problem or "the caller names no client")
    client = caller.client
    async with locks(client):
        left = await asyncio.to_thread(unfinished, queue, client)
        if left + count > cap:
            refused()
            raise QuotaExceeded(
                f"client {client!r} has {left} queries queued or running and submits "
                f"{count}; the cap is max_queued_per_client={cap}"
            )
        return await create(creation_writes(batch_id, owner, client))  # counts as soon as it exists


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
