"""One rule for a field written once on a record that may have expired: the first write wins, and a
record that is gone is not brought back (a batch's owner; an OpenAI batch's first ``in_progress_at``,
``cancelling_at`` and ``finalize_error``)."""

from __future__ import annotations

from typing import Any

SET_ONCE = """
if redis.call('HEXISTS', KEYS[1], ARGV[3]) == 0 then return false end
redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
return redis.call('HGET', KEYS[1], ARGV[1])
"""


def set_once(r: Any, key: str, field: str, value: str | float, present: str) -> str | None:
    """Set ``field`` of the hash ``key`` unless it is set; returns the value it holds now (the first
    writer's), or None when the record is gone. The record counts as there while its field ``present``
    (one every record has from its creation) is: a stray write to an expired key makes no record."""
    kept = r.eval(SET_ONCE, 1, key, field, value, present)
    return kept.decode() if isinstance(kept, bytes) else kept
