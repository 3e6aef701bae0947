"""The one rule for a field written once on a record that may have expired (workqueue/set_once.py)."""

from __future__ import annotations

import redis

from workqueue.set_once import set_once


def test_the_first_write_wins_and_a_gone_record_is_not_brought_back(redis_url):
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    r.hset("rec", mapping={"created_at": "1"})
    assert set_once(r, "rec", "owner", "alice", present="created_at") == "alice"
    assert set_once(r, "rec", "owner", "bob", present="created_at") == "alice"  # the first writer's
    assert r.hget("rec", "owner") == "alice"
    assert set_once(r, "gone", "owner", "bob", present="created_at") is None
    assert not r.exists("gone")
    r.hset("stray", "counter", 1)  # a late write to an expired record's key: no record
    assert set_once(r, "stray", "owner", "bob", present="created_at") is None
    assert r.hgetall("stray") == {"counter": "1"}
    raw = redis.Redis.from_url(redis_url)  # a client without decoding gets text too
    assert set_once(raw, "rec", "owner", "carol", present="created_at") == "alice"
