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
    sweep = q.batch_ops._sweep

    def recording_sweep(*, keys, args):
        n, seen, nxt = sweep(keys=keys, args=args)
        looked.append(int(seen))
        return n, seen, nxt

    q.batch_ops._sweep = recording_sweep
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
        q.batch_ops._cancel(keys=[wq_keys.batch("x")], args=["x", 0.0]) == 1
    )  # marked, not swept yet (as if the sweep missed them)
    assert q.claim("a", 5, "w", 30) == []
    assert q.batch("x").status == "cancelled" and q.batch("x").cancelled == 5
    assert check(q.r) == []


def test_cancel_drops_ids_without_a_hash_and_never_recreates_one(redis_url):
    q = WorkQueue(connect(redis_url))
    q.register_cluster("a")
    q.create_batch("x", [(QueuedQuery("x", f"q{i}", "p", 8, 4, 6.0), "a") for i in range(3)])
    claimed = q.claim("a", 1, "w", 30)[0]
    q.complete(claimed.query.gid, {"query_id": "q0"}, "completed", 1)  # q0 done: its hash is gone
    q.r.zadd(wq_keys.queue("a"), {"x:q0": 0})  # a stray id left behind (as older code could leave)
    assert q.cancel_batch("x") == 2  # q1 and q2; the stray q0 is dropped, not counted
    assert q.queued_ids("a") == [] and not q.r.exists(wq_keys.query("x:q0"))
    assert check(q.r) == []


def test_a_claim_that_meets_cancelled_ids_does_not_rescan_the_queue(redis_url):
    q = WorkQueue(connect(redis_url))
    q.register_cluster("a")
    q.create_batch("x", [(QueuedQuery("x", f"q{i}", "p", 8, 4, 6.0), "a") for i in range(3)])
    q.create_batch("y", [(QueuedQuery("y", "q0", "p", 8, 4, 6.0), "a")])
    assert q.batch_ops._cancel(keys=[wq_keys.batch("x")], args=["x", 0.0]) == 1  # marked, not swept
    before = int(q.r.info("commandstats").get("cmdstat_lrem", {}).get("calls", 0))
    assert [c.query.gid for c in q.claim("a", 1, "w", 30)] == ["y:q0"]
    after = int(q.r.info("commandstats").get("cmdstat_lrem", {}).get("calls", 0))
    assert after == before  # finish() knew the ids were already popped
    assert q.batch("x").cancelled == 3 and check(q.r) == []
