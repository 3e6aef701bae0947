"""A batch whose window ends while its last rows run, and whose every row then completes normally, ends
``completed``, not ``expired`` (issue 48, finding 7); one with a row stopped by its expiry still ends ``expired``."""

from __future__ import annotations

from tests.test_queue_deadlines import T0, Clock, answer, queue, rows
from workqueue.invariants import check


def test_a_batch_whose_rows_all_completed_after_its_deadline_ends_completed(redis_url):
    clock = Clock()
    q = queue(redis_url, clock)
    q.create_batch("x", rows("x", 3), deadline=T0 + 600)
    first, second, third = q.claim("a", 3, "w", 60)
    answer(q, first)
    clock.t = T0 + 601
    assert q.expire_due(clock.t) == ["x"] and q.batch("x").status == "expiring"
    answer(q, second)  # its worker had not aborted them yet: both finish normally
    answer(q, third)
    x = q.batch("x")
    assert (x.status, x.completed, x.failed, x.cancelled) == ("completed", 3, 0, 0)
    assert check(q.r) == []


def test_a_batch_with_a_row_stopped_by_its_expiry_ends_expired(redis_url):
    clock = Clock()
    q = queue(redis_url, clock)
    q.create_batch("y", rows("y", 2), deadline=T0 + 600)
    done, running = q.claim("a", 2, "w", 60)
    clock.t = T0 + 601
    assert q.expire_due(clock.t) == ["y"]
    answer(q, done)
    answer(q, running, "cancelled", "cancelled", 0)  # aborted by its worker: the expiry stopped it
    y = q.batch("y")
    assert (y.status, y.completed, y.cancelled) == ("expired", 1, 1)
    assert check(q.r) == []
