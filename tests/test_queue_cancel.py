"""Cancel is lazy with a bounded sweep (R4): no single Redis call scans a whole big queue."""

from __future__ import annotations

from workqueue import QueuedQuery, WorkQueue, connect
from workqueue import keys as wq_keys
from workqueue.invariants import check


def test_cancel_sweeps_in_bounded_calls_and_leaves_other_batches_alone(redis_url):
    q = WorkQueue(connect(redis_url))
    q.register_cluster("a")
    q.register_cluster("b")
    for bid in ("x", "y"):  # interleaved on both queues
        rows = [(QueuedQuery(bid, f"q{i}", "p", 8, 4, 6.0), "ab"[i % 2]) for i in range(3000)]
        q.create_batch(bid, rows)
    looked: list[int] = []
    sweep = q._sweep

    def recording_sweep(*, keys, args):
        n, seen, nxt = sweep(keys=keys, args=args)
        looked.append(int(seen))
        return n, seen, nxt

    q._sweep = recording_sweep
    assert q.cancel_batch("x", chunk=400) == 3000
    assert max(looked) <= 400 and len(looked) >= 2 * 3000 // 400
    assert q.batch("x").status == "cancelled" and q.batch("x").cancelled == 3000
    assert q.batch("y").status == "in_progress"
    left = q.queued_ids("a") + q.queued_ids("b")
    assert len(left) == 3000 and all(g.startswith("y:") for g in left)
    assert sum(c.pending_tokens for c in q.clusters()) == 3000 * 10
    assert check(q.r) == []
    assert q.cancel_batch("x") == 0 and q.cancel_batch("nope") == -1


def test_a_claim_drops_queries_of_a_cancelling_batch_that_the_sweep_missed(redis_url):
    q = WorkQueue(connect(redis_url))
    q.register_cluster("a")
    q.create_batch("x", [(QueuedQuery("x", f"q{i}", "p", 8, 4, 6.0), "a") for i in range(5)])
    assert (
        q._cancel(keys=[wq_keys.batch("x")], args=["x", 0.0]) == 1
    )  # marked, not swept yet (as if the sweep missed them)
    assert q.claim("a", 5, "w", 30) == []
    assert q.batch("x").status == "cancelled" and q.batch("x").cancelled == 5
    assert check(q.r) == []
