"""A CLAIM that meets a stopped batch at the head of the queue finishes a bounded number of its rows per call
(issue [4/7], finding 3): the rest are the bounded sweep's (or the next claims'), so Redis is never blocked for
long by one script, whatever the stopped batch holds."""

from __future__ import annotations

import time

from tests.test_queue_faults import make_queue, queries
from workqueue.invariants import check
from workqueue.scripts import CLAIM_STOPPED_MAX


def test_a_claim_finishes_a_bounded_number_of_an_expiring_batchs_rows(redis_url):
    q = make_queue(redis_url)
    now = time.time()
    big = 4 * CLAIM_STOPPED_MAX
    assert q.create_batch("big", [(x, "a") for x in queries("big", big)], deadline=now + 60)
    assert q.create_batch("next", [(x, "a") for x in queries("next", 3)], deadline=now + 3600)
    assert q.expire_due_call(now + 120).run() == ["big"]  # expiring; the sweep has not run yet
    assert q.claim("a", 1, "w", 60) == []  # this call only finished expired rows, at most the bound
    left = [g for g in q.queued_ids("a") if g.startswith("big:")]
    assert len(left) == big - CLAIM_STOPPED_MAX
    while not (claimed := q.claim("a", 1, "w", 60)):  # the next claims (or the sweep) finish the rest
        pass
    assert claimed[0].query.gid == "next:q0"
    assert not [g for g in q.queued_ids("a") if g.startswith("big:")]
    assert q.batch("big").status == "expired"
    assert check(q.r) == []
