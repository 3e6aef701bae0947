"""Retention of the HTTP front's records and files, and file deletion (``DELETE /v1/files/{id}``).

**Retention follows the gateway batch's.** The queue gives a final batch's keys a TTL of its
``retention_s`` (``fleetbatch gateway serve --retention-hours``; 0 keeps them forever). When the finalizer
has written a batch's files, :func:`retire` copies the gateway batch's remaining TTL onto the
record ``{fb}:oai:b:<id>`` (both expire together) and schedules, in the ZSET ``{fb}:oai:expire``
scored by the time they are due, the batch id (``b:<id>``: leaves the batch list and the
pending set) and its output, error and input files (``f:<id>``; ``ZADD GT``: a file shared by
several batches goes with the last of them). :func:`sweep`, run by the finalizer loop, acts on
what is due. An input file still read by a batch that is not finalized yet is spared (that
batch schedules it again when it is finalized). Uploaded files no batch used, and files of a
deployment with retention 0, stay until ``DELETE /v1/files/{id}``.

**Deleting a file** (:func:`delete_file`) is refused (:class:`InUse`, HTTP 409) while the file
is the input of a batch not finalized yet: the finalizer reads it to name the output lines.
Against a batch being created from the file at the same moment, the deleter raises a Redis
counter ``{fb}:oai:fdel:<id>`` before it looks at the pending batches, and the creator
(:func:`deleting`) looks at that counter and at the file after its record is in the pending
set: one of the two always sees the other.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import redis

from gateway.http_api.batches import LIST, PENDING, record_key
from gateway.http_api.files import FileStore
from workqueue import WorkQueue, keys

log = logging.getLogger(__name__)

EXPIRE = keys.OAI_EXPIRE  # ZSET: "b:<batch id>" and "f:<file id>" by the time they are due
SWEEP_CHUNK = 1000  # due entries one sweep looks at
DELETING_TTL_MS = 30_000  # a deleter that dies leaves its mark this long
# KEYS: the expiry ZSET. ARGV: now, then members: remove those still due.
ZREM_IF_DUE = """
local n = 0
for i = 2, #ARGV do
  local s = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if s and tonumber(s) <= tonumber(ARGV[1]) then n = n + redis.call('ZREM', KEYS[1], ARGV[i]) end
end
return n
"""


class InUse(Exception):
    """The file is the input of a batch that is not finalized yet."""

    def __init__(self, file_id: str, batch_id: str):
        super().__init__(
            f"file {file_id} is the input of batch {batch_id}, which is not finalized yet; "
            "delete it once the batch is completed, failed or cancelled"
        )
        self.file_id, self.batch_id = file_id, batch_id


def _deleting_key(file_id: str) -> str:
    return keys.oai_deleting(file_id)


def pending_inputs(queue: WorkQueue) -> dict[str, str]:
    """``input file id -> batch id`` of the batches whose files are not written yet."""
    ids = sorted(queue.r.smembers(PENDING))
    pipe = queue.r.pipeline(transaction=False)
    for b in ids:
        pipe.hget(record_key(b), "input_file_id")
    return {f: b for b, f in zip(ids, pipe.execute(), strict=True) if f}


@contextlib.contextmanager
def _marked(queue: WorkQueue, file_ids: list[str]) -> Iterator[None]:
    """Raise the "being deleted" counter of each file for the duration."""
    pipe = queue.r.pipeline(transaction=True)
    for f in file_ids:
        pipe.incr(_deleting_key(f))
        pipe.pexpire(_deleting_key(f), DELETING_TTL_MS)
    pipe.execute()
    try:
        yield
    finally:
        pipe = queue.r.pipeline(transaction=False)
        for f in file_ids:
            pipe.decr(_deleting_key(f))
        for f, left in zip(file_ids, pipe.execute(), strict=True):
            if left <= 0:
                queue.r.delete(_deleting_key(f))


def delete_files(queue: WorkQueue, store: FileStore, file_ids: list[str]) -> dict[str, bool | str]:
    """Delete stored files: ``file id -> True`` (deleted), ``False`` (there was none) or the id of
    the pending batch whose input it is (kept)."""
    out: dict[str, bool | str] = {}
    with _marked(queue, file_ids):
        reading = pending_inputs(queue)
        for f in file_ids:
            out[f] = reading[f] if f in reading else store.delete(f)
    return out


def delete_file(queue: WorkQueue, store: FileStore, file_id: str) -> bool:
    """Delete a stored file; False when there is none; :class:`InUse` while a pending batch reads it."""
    done = delete_files(queue, store, [file_id])[file_id]
    if isinstance(done, str):
        raise InUse(file_id, done)
    return done


def deleting(queue: WorkQueue, store: FileStore, file_id: str) -> bool:
    """For a batch creation, after its record is pending: is its input file gone or being deleted?"""
    return int(queue.r.get(_deleting_key(file_id)) or 0) > 0 or store.info(file_id) is None


def retire(
    queue: WorkQueue, batch_id: str, file_ids: list[str], fallback_s: float, pipe: redis.client.Pipeline
) -> None:
    """Queue on ``pipe`` (the finalizer's transaction) what gives a finalized batch's record the
    gateway batch's remaining TTL and schedules it and its files.

    No TTL on the gateway batch (retention 0): nothing expires. Its hash already gone: the
    record keeps ``fallback_s`` (the gateway's ``retention_s``; 0: forever).
    """
    ttl_ms = queue.r.pttl(keys.batch(batch_id))
    if ttl_ms == -2:
        ttl_ms = int(fallback_s * 1000) or -1
    if ttl_ms < 0:
        return
    due = time.time() + ttl_ms / 1000
    pipe.pexpire(record_key(batch_id), max(1, ttl_ms))
    pipe.zadd(EXPIRE, {"b:" + batch_id: due})
    members = {"f:" + f: due for f in file_ids if f}
    if members:
        pipe.zadd(EXPIRE, members, gt=True)


def expire_orphan(queue: WorkQueue, batch_id: str, retention_s: float) -> None:
    """A record whose gateway batch never appeared (or vanished): ``expired`` now, kept ``retention_s``."""
    pipe = queue.r.pipeline(transaction=True)
    pipe.hset(record_key(batch_id), "expired_at", time.time())
    pipe.srem(PENDING, batch_id)
    if retention_s > 0:
        pipe.expire(record_key(batch_id), max(1, int(retention_s)))
        pipe.zadd(EXPIRE, {"b:" + batch_id: time.time() + retention_s})
    pipe.execute()


def sweep(queue: WorkQueue, store: FileStore, now: float | None = None, chunk: int = SWEEP_CHUNK) -> int:
    """Act on up to ``chunk`` due entries: expired batch ids leave the list, the pending set and
    Redis; expired files are deleted (an input file a pending batch reads is spared: that batch
    schedules it again when finalized). Returns how many entries were handled."""
    r = queue.r
    now = time.time() if now is None else now
    due = r.zrangebyscore(EXPIRE, "-inf", now, start=0, num=chunk)
    if not due:
        return 0
    batches = [m[2:] for m in due if m.startswith("b:")]
    if batches:
        pipe = r.pipeline(transaction=True)
        for b in batches:
            pipe.delete(record_key(b))
        pipe.zrem(LIST, *batches)
        pipe.srem(PENDING, *batches)
        pipe.execute()
    files = [m[2:] for m in due if m.startswith("f:")]
    if files:
        for f, done in delete_files(queue, store, files).items():
            if done is True:
                log.info("file %s expired with its batch: deleted", f)
    r.eval(ZREM_IF_DUE, 1, EXPIRE, now, *due)  # one whose score moved on meanwhile stays
    return len(due)
