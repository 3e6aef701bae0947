"""A worker gives back only the queries it still runs (issue [4/7], finding 5): a worker that stops
after a partition outlasted its lease must not end another worker's lease, refund its attempt, or bring
back a finished row's hash."""

from __future__ import annotations

from tests.test_queue_faults import make_queue, queries
from workqueue import keys
from workqueue.invariants import check


def test_a_late_release_leaves_the_query_another_worker_took_over(redis_url):
    q = make_queue(redis_url, max_attempts=3)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 1)])
    (first,) = q.claim("a", 1, "w1", 0)  # w1's lease lapses at once (a partition outlasted it)
    assert q.requeue_expired("a") == 1
    (second,) = q.claim("a", 1, "w2", 60)  # w2 runs it now, on its second attempt
    gid = second.query.gid
    deadline = q.r.zscore(keys.inflight("a"), gid)
    q.release("a", [gid], started=False, worker="w1")  # w1 comes back and gives up what it had claimed
    assert q.r.zscore(keys.inflight("a"), gid) == deadline  # w2's lease stands
    assert q.r.hget(keys.query(gid), "attempts") == "2" and q.r.hget(keys.query(gid), "worker") == "w2"
    assert q.queued_ids("a") == []
    assert check(q.r) == []
    assert first.query.gid == gid


def test_a_release_after_the_row_finished_does_not_bring_its_hash_back(redis_url):
    q = make_queue(redis_url)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 1)])
    (c,) = q.claim("a", 1, "w1", 60)
    gid = c.query.gid
    assert q.complete(gid, {"batch_id": "b1", "query_id": c.query.query_id, "text": "x"}) >= 0
    q.r.delete(keys.query(gid))  # the finished row's hash expired with its batch
    q.release("a", [gid], started=False, worker="w1")
    assert not q.r.exists(keys.query(gid))


def test_the_worker_that_runs_a_query_still_gives_it_back(redis_url):
    q = make_queue(redis_url, max_attempts=3)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 2)])
    a, b = q.claim("a", 2, "w1", 60)
    assert q.release("a", [a.query.gid], started=False, worker="w1") == 1  # claimed ahead, never run
    assert q.release("a", [b.query.gid], worker="w1") == 1  # ran, then its engine failed
    assert q.r.hget(keys.query(a.query.gid), "attempts") == "0"
    assert q.r.hget(keys.query(b.query.gid), "attempts") == "1"
    assert sorted(q.queued_ids("a")) == sorted([a.query.gid, b.query.gid])
    assert check(q.r) == []
