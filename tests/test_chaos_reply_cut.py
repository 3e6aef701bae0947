"""The reply-cut proxy of ``loadgen chaos`` (:mod:`load.reply_cut`) against a real Redis: a call runs, its reply
is lost, the client's connection is reset and redis-py sends the call (or its whole pipeline) again."""

from __future__ import annotations

import hashlib

import pytest
import redis

from load.reply_cut import ReplyCutProxy, RespCounter, decode
from workqueue import WorkQueue, connect

pytestmark = pytest.mark.fault

COUNT = "return redis.call('INCR', KEYS[1])"


def test_the_counter_finds_each_message_end_across_pieces():
    messages = [b"*2\r\n$4\r\nINCR\r\n$1\r\nk\r\n", b"*3\r\n*1\r\n:1\r\n$-1\r\n$3\r\nabc\r\n", b"+OK\r\n"]
    stream = b"".join(messages)
    want = [sum(len(m) for m in messages[: k + 1]) for k in range(3)]
    for cut in range(1, len(stream)):  # fed in two pieces, split anywhere
        c = RespCounter(keep_args=2)
        ends = [(e, a) for e, a in c.feed(stream[:cut])] + [(e + cut, a) for e, a in c.feed(stream[cut:])]
        assert [e for e, _ in ends] == want, cut
        assert ends[0][1] == [b"INCR", b"k"]
    assert decode(b"*3\r\n:0\r\n$2\r\nab\r\n*1\r\n$-1\r\n") == [0, b"ab", [None]]


def test_a_lost_reply_after_the_call_ran_is_sent_again_by_redis_py(redis_url):
    base = connect(redis_url)
    sha = base.script_load(COUNT).encode()
    with_sha = hashlib.sha1(COUNT.encode()).hexdigest().encode()
    assert sha == with_sha
    proxy = ReplyCutProxy(redis_url.removeprefix("unix://")).start()
    try:
        client = connect(proxy.url)
        proxy.arm("count", b"EVALSHA", sha, times=1)
        pipe = client.pipeline(transaction=False)
        pipe.set("before", 1)
        pipe.evalsha(sha, 1, "n")
        pipe.get("before")
        assert pipe.execute() == [True, 2, "1"]  # the first run's reply was lost: the pipeline ran twice
        assert base.get("n") == "2" and proxy.hit_count("count") == 1
        assert decode(proxy.hits["count"][0].reply) == 1
        assert client.evalsha(sha, 1, "n") == 3  # disarmed after one cut
        # a reply the predicate refuses goes through, and the rule stays armed for the next one
        proxy.arm("count", b"EVALSHA", sha, times=1, reply=lambda r: decode(r) >= 5)
        assert client.evalsha(sha, 1, "n") == 4
        assert client.evalsha(sha, 1, "n") == 6  # 5 ran, its reply lost, sent again
        assert proxy.hit_count("count") == 2
        # inside MULTI the call runs at EXEC: the EXEC's reply is the one lost
        proxy.arm("count", b"EVALSHA", sha, times=1)
        tx = client.pipeline(transaction=True)
        tx.evalsha(sha, 1, "n")
        assert tx.execute() == [8]
        # a queue works through it as it does directly
        q = WorkQueue(client)
        assert q.batch("none") is None
    finally:
        proxy.close()


def test_with_no_retries_left_the_caller_sees_the_lost_reply(redis_url):
    base = connect(redis_url)
    sha = base.script_load(COUNT).encode()
    proxy = ReplyCutProxy(redis_url.removeprefix("unix://")).start()
    try:
        client = redis.Redis.from_url(proxy.url, decode_responses=True, retry=None)
        client.ping()
        proxy.arm("count", b"EVALSHA", sha, times=1)
        with pytest.raises(redis.ConnectionError):
            client.evalsha(sha, 1, "m")
        assert base.get("m") == "1"  # it ran
    finally:
        proxy.close()
