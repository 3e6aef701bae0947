"""Deadlines in the queue: earliest deadline first (or FIFO), priorities, expiry that keeps finished rows and
fails the rest as ``batch_expired``, and each batch's token progress."""

from __future__ import annotations

import uuid

from workqueue import QueuedQuery, WorkQueue, connect
from workqueue import keys as wq_keys
from workqueue.invariants import check
from workqueue.ordering import QueueOrder
from workqueue.records import Outcome, QueryResult
from workqueue.upgrade import upgrade_queues

T0 = 1_800_000_000.0


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def rows(bid: str, n: int, cluster: str = "a", tokens: float = 6.0) -> list[tuple[QueuedQuery, str]]:
    return [(QueuedQuery(bid, f"q{i}", "p", 8, 4, tokens), cluster) for i in range(n)]


def queue(redis_url: str, clock: Clock, **kw) -> WorkQueue:
    q = WorkQueue(connect(redis_url), clock=clock, **kw)
    for c in ("a", "b"):
        q.register_cluster(c)
    return q


def claimed_batches(q: WorkQueue, n: int) -> list[str]:
    return [c.query.batch_id for c in q.claim("a", n, "w", 60)]


def test_the_earliest_deadline_runs_first_and_fifo_keeps_submission_order(redis_url):
    clock = Clock()
    q = queue(redis_url, clock)
    q.create_batch("late", rows("late", 3), deadline=T0 + 6 * 3600)
    clock.t += 10
    q.create_batch("soon", rows("soon", 3), deadline=T0 + 1800)
    clock.t += 10
    q.create_batch("none", rows("none", 2))  # no deadline: keyed as if its window were 24 h
    assert claimed_batches(q, 8) == ["soon"] * 3 + ["late"] * 3 + ["none"] * 2

    q.r.flushall()
    fifo = queue(redis_url, clock, order=QueueOrder("fifo"))
    fifo.create_batch("late", rows("late", 3), deadline=T0 + 6 * 3600)
    clock.t += 10
    fifo.create_batch("soon", rows("soon", 3), deadline=T0 + 1800)
    assert claimed_batches(fifo, 6) == ["late"] * 3 + ["soon"] * 3


def test_a_priority_moves_a_batch_ahead_by_its_steps_and_no_further(redis_url):
    clock = Clock()
    q = queue(redis_url, clock, order=QueueOrder("edf", priority_step_s=3600))
    q.create_batch("urgent", rows("urgent", 2), deadline=T0 + 3600)
    q.create_batch("vip", rows("vip", 2), deadline=T0 + 2 * 3600 + 60, priority=1)  # one step: 1 h 1 min
    q.create_batch("vip2", rows("vip2", 2), deadline=T0 + 2 * 3600 + 60, priority=2)  # two steps: ahead
    assert claimed_batches(q, 6) == ["vip2"] * 2 + ["urgent"] * 2 + ["vip"] * 2
    assert q.batch("vip").priority == 1 and q.batch("vip").order_key == T0 + 3600 + 60


def test_requeued_and_moved_queries_keep_their_place_in_the_order(redis_url):
    clock = Clock()
    q = queue(redis_url, clock)
    q.create_batch("late", rows("late", 2), deadline=T0 + 7200)
    q.create_batch("soon", rows("soon", 2), deadline=T0 + 600)
    (first,) = q.claim("a", 1, "w", 0.001)  # a lease that lapses at once: its worker "died"
    assert first.query.gid == "soon:q0"
    while q.requeue_expired("a") == 0:
        pass
    assert q.queued_ids("a") == ["soon:q0", "soon:q1", "late:q0", "late:q1"]  # back at the head, not the back
    q.create_batch("b-late", rows("b-late", 1, "b"), deadline=T0 + 9000)
    assert q.move_ids("a", "b", ["soon:q1", "late:q0"]) == (2, 20.0)
    assert q.queued_ids("b") == ["soon:q1", "late:q0", "b-late:q0"]  # by deadline, not in the order they came
    assert q.batch("soon").left_tokens_per_cluster == {"a": 10.0, "b": 10.0}
    assert check(q.r) == []


def answer(q: WorkQueue, cq, kind: str = "completed", reason: str = "stop", completion: int = 5) -> int:
    bid, qid = cq.query.batch_id, cq.query.query_id
    result = QueryResult(
        bid, qid, text="x", prompt_tokens=4, completion_tokens=completion, finish_reason=reason
    )
    return q.complete(cq.query.gid, result, kind, completion)


def test_expiry_keeps_the_finished_rows_and_fails_the_rest_once_each(redis_url):
    clock = Clock()
    q = queue(redis_url, clock)
    q.create_batch("x", rows("x", 6), deadline=T0 + 600)
    q.create_batch("y", rows("y", 2), deadline=T0 + 6000)
    done, running = q.claim("a", 2, "w", 60)
    answer(q, done)
    assert q.expire_due(T0 + 599) == [] and q.batch("x").status == "in_progress"
    clock.t = T0 + 601
    start = q.requeue_and_expire()  # the offloader's tick: one round trip, then the sweep
    assert start.expired == ["x"] and start.requeued == {"a": 0, "b": 0}
    assert [b.batch_id for b in start.unfinished] == ["y"]  # x stops: it has no ETA any more
    assert q.batch("x").status == "expiring"  # its running query is still to be aborted
    assert q.queued_ids("a") == ["y:q0", "y:q1"]
    assert q.cancel_batch("x") == 0  # its window ended first: it ends expired, not cancelled
    assert answer(q, running, "cancelled", "cancelled", 0) >= 0  # its worker aborted it
    x = q.batch("x")
    assert (x.status, x.total, x.completed, x.failed, x.cancelled) == ("expired", 6, 1, 0, 5)
    results = q.query_results("x")
    assert sorted(r.query_id for r in results) == [f"q{i}" for i in range(6)]
    expired_rows = [r for r in results if r.finish_reason == "batch_expired"]
    assert len(expired_rows) == 5 and all(r.outcome is Outcome.CANCELLED and r.error for r in expired_rows)
    assert [r.query_id for r in results if r.outcome is Outcome.COMPLETED] == [done.query.query_id]
    assert x.left_tokens_per_cluster == {} and not q.r.zscore(wq_keys.DEADLINES, "x")
    assert q.batch("y").status == "in_progress" and q.expire_due(T0 + 602) == []
    assert check(q.r) == []


def test_a_batch_expires_during_its_background_intake(redis_url):
    clock = Clock()
    q = queue(redis_url, clock)
    payloads = [f'{{"id": "q{i}"}}' for i in range(4)]
    assert q.accept_batch("big", payloads, deadline=T0 + 60)
    token = uuid.uuid4().hex
    assert q.take_intake("big", token, 30)
    first = [(f"big:q{i}", '{"batch_id": "big"}', 6.0, "a") for i in range(2)]
    assert q.enqueue_chunk("big", token, 0, first, 30) == 2
    assert q.expire_due(T0 + 61) == ["big"]
    assert q.queued_ids("a") == []
    rest = [(f"big:q{i}", '{"batch_id": "big"}', 6.0, "a") for i in range(2, 4)]
    assert q.enqueue_chunk("big", token, 2, rest, 30) == 2  # rows landing after expiry land expired
    b = q.batch("big")
    assert (b.status, b.cancelled) == ("expired", 4)
    assert {r.finish_reason for r in q.query_results("big")} == {"batch_expired"}
    assert check(q.r) == []


def test_a_cancelled_batch_does_not_expire_and_a_finished_one_leaves_the_deadlines(redis_url):
    clock = Clock()
    q = queue(redis_url, clock)
    q.create_batch("c", rows("c", 2), deadline=T0 + 10)
    q.create_batch("f", rows("f", 1), deadline=T0 + 10)
    q.cancel_batch("c")
    (cq,) = [c for c in q.claim("a", 5, "w", 60) if c.query.batch_id == "f"]
    answer(q, cq)
    assert q.r.zcard(wq_keys.DEADLINES) == 0
    assert q.expire_due(T0 + 100) == []
    assert (q.batch("c").status, q.batch("f").status) == ("cancelled", "completed")


def test_each_batch_counts_its_token_progress(redis_url):
    clock = Clock()
    q = queue(redis_url, clock)
    q.create_batch(
        "p", rows("p", 3, "a", tokens=6.0) + rows("p2", 0) + [(QueuedQuery("p", "qb", "p", 8, 4, 16.0), "b")]
    )
    p = q.batch("p")
    assert p.predicted_tokens == 3 * 10 + 20 and p.left_tokens_per_cluster == {"a": 30.0, "b": 20.0}
    first, second = q.claim("a", 2, "w", 60)
    answer(q, first, completion=9)  # predicted 6 response tokens, 9 came: actual 4 + 9
    answer(q, second, "failed", "error", 0)
    p = q.batch("p")
    assert (p.done_predicted_tokens, p.done_actual_tokens) == (10.0, 13)  # answered rows only
    assert p.left_tokens_per_cluster == {"a": 10.0, "b": 20.0}


def test_a_queue_left_as_a_list_by_an_older_version_is_upgraded_in_order(redis_url):
    clock = Clock()
    q = queue(redis_url, clock)
    q.create_batch("old", rows("old", 3))
    clock.t += 5
    q.create_batch("older-style", rows("older-style", 2))
    ids = q.queued_ids("a")
    q.r.delete(wq_keys.queue("a"))
    q.r.rpush(wq_keys.queue("a"), *reversed(ids))  # as the old code left it: a list, in its own order
    for bid in ("old", "older-style"):
        q.r.hdel(wq_keys.batch(bid), "order_key")
    assert upgrade_queues(q.r, QueueOrder()) == {"a": 5}
    upgraded = ["old:q2", "old:q1", "old:q0", "older-style:q1", "older-style:q0"]
    assert q.queued_ids("a") == upgraded  # by batch (creation + 24 h), then the list's order within one
    assert q.batch("old").order_key == T0 + 86400  # written into the batch: its next rows land in order
    assert upgrade_queues(q.r, QueueOrder("fifo")) == {}  # a sorted set already, keys kept: left alone
    assert q.batch("old").order_key == T0 + 86400
    assert [c.query.gid for c in q.claim("a", 5, "w", 60)] == upgraded
    assert check(q.r) == []
