"""Queue faults of issue 13 (R1, R2, R3, R5) against a real Redis: late completions, skewed
clocks, concurrent and half-done batch creation, poison queries (which give up at their next
claim, so a live worker on its last attempt can take its query back after a long outage).

Lapsed leases come from negative lease times (the deadline is already past when the claim
returns), not from sleeping; the one test that needs a lease to run out in real time sleeps
well under a second.
"""

from __future__ import annotations

import threading
import time

import pytest

from workqueue import QueuedQuery, WorkQueue, connect, keys
from workqueue.invariants import check


def make_queue(url: str, **kw) -> WorkQueue:
    return WorkQueue(connect(url), **kw)


def skewed(url: str, skew_s: float) -> WorkQueue:
    """A client whose clock is ``skew_s`` seconds off."""
    return make_queue(url, clock=lambda: time.time() + skew_s)


def queries(batch: str, n: int, tokens: float = 10.0) -> list[QueuedQuery]:
    return [QueuedQuery(batch, f"q{i}", f"prompt {i}", 16, 4, tokens - 4) for i in range(n)]


def pending(q: WorkQueue, cluster: str) -> float:
    return float(q.r.get(keys.pending(cluster)) or 0)


def query_keys(q: WorkQueue) -> list[str]:
    return sorted(q.r.scan_iter(match=keys.query("*")))


def result_ids(q: WorkQueue, batch: str) -> list[str]:
    return sorted(r["query_id"] for r in q.results(batch))


# ---------------------------------------------------------------------- R1: late completions


def test_late_completion_after_requeue_reconciles_queue_and_pending(redis_url):
    q = make_queue(redis_url)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 2)])
    (old,) = q.claim("a", 1, "old-worker", lease_s=-1.0)  # its lease has already lapsed
    assert q.requeue_expired("a") == 1
    assert q.queued_ids("a") == ["b1:q0", "b1:q1"]
    assert abs(pending(q, "a") - 20.0) < 1e-6
    # the old worker was only slow: it completes the query after all
    assert q.complete(old.query.gid, {"query_id": "q0", "text": "late"}, "completed", 3) == 0
    assert q.queued_ids("a") == ["b1:q1"], "the finished query is still queued"
    assert abs(pending(q, "a") - 10.0) < 1e-6
    (rest,) = q.claim("a", 5, "w2", 30)
    assert rest.query.gid == "b1:q1"
    assert q.complete(rest.query.gid, {"query_id": "q1"}, "completed", 3) == 1
    assert q.complete(old.query.gid, {"query_id": "q0", "text": "again"}) == -1
    info = q.batch("b1")
    assert (info.status, info.completed, info.failed) == ("completed", 2, 0)
    assert result_ids(q, "b1") == ["q0", "q1"]
    assert q.queued_ids("a") == [] and q.inflight_ids("a") == []
    assert abs(pending(q, "a")) < 1e-6
    assert query_keys(q) == []


def test_move_tail_after_a_late_completion_recreates_nothing(redis_url):
    q = make_queue(redis_url)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 2)])
    (old,) = q.claim("a", 1, "old-worker", lease_s=-1.0)
    assert q.requeue_expired("a") == 1
    assert q.complete(old.query.gid, {"query_id": "q0", "text": "late"}) == 0
    assert q.move_tail("a", "b", 5) == (1, 10.0)
    assert q.queued_ids("a") == [] and q.queued_ids("b") == ["b1:q1"]
    assert abs(pending(q, "a")) < 1e-6 and abs(pending(q, "b") - 10.0) < 1e-6
    (c,) = q.claim("b", 5, "w", 30)
    q.complete(c.query.gid, {"query_id": "q1"})
    assert q.batch("b1").status == "completed"
    assert result_ids(q, "b1") == ["q0", "q1"]
    assert abs(pending(q, "a")) < 1e-6 and abs(pending(q, "b")) < 1e-6
    assert query_keys(q) == [], "a query hash outlived its query"


def test_late_completion_of_a_requeued_and_moved_query(redis_url):
    q = make_queue(redis_url)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 1)])
    (old,) = q.claim("a", 1, "old-worker", lease_s=-1.0)
    assert q.requeue_expired("a") == 1
    assert q.move_tail("a", "b", 1) == (1, 10.0)
    assert q.complete(old.query.gid, {"query_id": "q0"}) == 0
    assert q.queued_ids("b") == [] and abs(pending(q, "b")) < 1e-6 and abs(pending(q, "a")) < 1e-6
    assert q.batch("b1").status == "completed"
    assert query_keys(q) == []


def test_ids_without_a_hash_are_skipped_never_recreated(redis_url):
    """Ids left in a queue by the old code (their query finished) are dropped by moves and claims."""
    q = make_queue(redis_url)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 1)])
    q.r.zadd(keys.queue("a"), {"b1:ghost": 2**52, "b1:ghost2": -(2**52)})  # at the back, at the front
    assert q.move_tail("a", "b", 1) == (1, 10.0)  # the ghost does not count as a move
    assert q.queued_ids("b") == ["b1:q0"]
    assert not q.r.exists(keys.query("b1:ghost"))
    assert q.claim("a", 5, "w", 30) == []
    assert not q.r.exists(keys.query("b1:ghost2"))
    assert q.queued_ids("a") == []


# ---------------------------------------------------------------------- R2: Redis time for leases


def test_lease_deadlines_use_redis_time_not_client_clocks(redis_url):
    behind = skewed(redis_url, -3600.0)  # a worker whose clock is an hour slow
    ahead = skewed(redis_url, +3600.0)  # an offloader whose clock is an hour fast
    assert behind.create_batch("b1", [(x, "a") for x in queries("b1", 2)])
    (c,) = behind.claim("a", 1, "w-behind", lease_s=30)
    assert ahead.requeue_expired("a") == 0, "a live lease was taken for expired"
    assert make_queue(redis_url).requeue_expired("a") == 0
    behind.renew("a", [c.query.gid], lease_s=30)
    assert ahead.requeue_expired("a") == 0
    assert behind.inflight_ids("a") == [c.query.gid]
    # a fast clock does not make a lease last longer either
    (d,) = ahead.claim("a", 1, "w-ahead", lease_s=0.2)
    assert behind.requeue_expired("a") == 0
    time.sleep(0.4)
    assert behind.requeue_expired("a") == 1, "a lease past its Redis-time deadline was kept"
    assert behind.queued_ids("a") == [d.query.gid]
    assert behind.inflight_ids("a") == [c.query.gid]


def test_lease_of_zero_lapses_at_once_and_release_requeues(redis_url):
    q = make_queue(redis_url)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 3)])
    q.claim("a", 1, "w", lease_s=0)
    assert q.requeue_expired("a") == 1
    held = q.claim("a", 2, "w", lease_s=30)
    assert q.release("a", [held[1].query.gid], worker="w") == 1
    assert q.queued_ids("a") == [held[1].query.gid, "b1:q2"]
    assert q.inflight_ids("a") == [held[0].query.gid]


def test_claim_timestamps_come_from_the_injected_clock(redis_url):
    q = skewed(redis_url, -3600.0)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 1)])
    (c,) = q.claim("a", 1, "w", 30)
    assert abs(c.enqueued_at - (time.time() - 3600)) < 60
    assert abs(c.claimed_at - (time.time() - 3600)) < 60


# ---------------------------------------------------------------------- R3: idempotent create


def test_concurrent_create_batch_with_one_id_creates_it_once(redis_url):
    for round_ in range(3):
        bid = f"b{round_}"
        qs = queries(bid, 3000)
        start = threading.Barrier(8)
        outcomes: list[object] = []
        lock = threading.Lock()

        def submit(i: int, bid=bid, qs=qs, start=start, outcomes=outcomes, lock=lock) -> None:
            wq = make_queue(redis_url)
            start.wait()
            try:
                created = wq.create_batch(bid, [(x, "abc"[i % 3]) for x in qs])
                # what the gateway does next: False must mean "this batch exists", readable now
                out: object = (created, wq.batch(bid) is not None)
            except Exception as e:  # noqa: BLE001 - the test reports any exception
                out = e
            with lock:
                outcomes.append(out)

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not [o for o in outcomes if isinstance(o, Exception)], outcomes
        assert sorted(outcomes) == [(False, True)] * 7 + [(True, True)], outcomes
        q = make_queue(redis_url)
        ids = q.queued_ids("a") + q.queued_ids("b") + q.queued_ids("c")
        ids = [g for g in ids if g.startswith(bid + ":")]
        assert sorted(ids) == sorted(x.gid for x in qs)
        info = q.batch(bid)
        assert info.total == 3000 and sum(info.queries_per_cluster.values()) == 3000


def test_half_created_batch_is_overwritten(redis_url):
    """A batch hash without ``status`` (the first of the old code's two writes) counts as absent."""
    q = make_queue(redis_url)
    q.r.hset(keys.batch("b1"), "created_at", 123.0)
    assert q.batch("b1") is None
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 2)]) is True
    info = q.batch("b1")
    assert (info.status, info.total) == ("in_progress", 2)
    assert info.created_at > 123.0
    assert q.queued_ids("a") == ["b1:q0", "b1:q1"]
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 2)]) is False
    assert q.queued_ids("a") == ["b1:q0", "b1:q1"]


# ---------------------------------------------------------------------- R5: poison queries


def lapse_after_crashes(q: WorkQueue, gid: str, times: int) -> None:
    """``times`` workers claim the head query ``gid`` and die: each lease lapses and is requeued."""
    for attempt in range(1, times + 1):
        (c,) = q.claim("a", 1, f"crashing-worker-{attempt}", lease_s=-1.0)
        assert (c.query.gid, c.attempts) == (gid, attempt)
        assert q.requeue_expired("a") == 1  # the worker died: its lease lapsed, the query goes back


def test_poison_query_fails_after_max_attempts_and_the_batch_goes_on(redis_url):
    q = make_queue(redis_url)  # max_attempts defaults to 3
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 3)])
    lapse_after_crashes(q, "b1:q0", 3)
    # requeued like any lapsed lease: it fails at its next claim, not before
    assert q.queued_ids("a") == ["b1:q0", "b1:q1", "b1:q2"] and abs(pending(q, "a") - 30.0) < 1e-6
    assert q.batch("b1").failed == 0
    got = q.claim("a", 5, "good-worker", 30)
    assert [c.query.gid for c in got] == ["b1:q1", "b1:q2"], "the poison query was handed out again"
    (row,) = q.results("b1")
    assert row["query_id"] == "q0" and row["finish_reason"] == "error" and row["cluster"] == "a"
    assert "failed 3 times" in row["error"] and row["attempts"] == 3
    info = q.batch("b1")
    assert (info.status, info.failed) == ("in_progress", 1)
    assert check(q.r) == []
    for c in got:
        q.complete(c.query.gid, {"query_id": c.query.query_id}, "completed", 2)
    info = q.batch("b1")
    assert (info.status, info.completed, info.failed) == ("completed", 2, 1)
    assert result_ids(q, "b1") == ["q0", "q1", "q2"]
    assert abs(pending(q, "a")) < 1e-6 and query_keys(q) == []
    # the last crashing worker coming back late changes nothing
    assert q.complete("b1:q0", {"query_id": "q0"}) == -1


@pytest.mark.parametrize("how", ["claim", "keeper"])
def test_a_live_worker_on_its_last_attempt_takes_its_query_back_after_a_long_outage(redis_url, how):
    """Review of issue 31: the query's max_attempts-th lease lapsed in a Redis outage while its worker
    lived. The requeue must not fail it: the worker's renewal (with its claim, or its keeper's) takes it
    back and its real result is the one written."""
    q = make_queue(redis_url)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 2)])
    lapse_after_crashes(q, "b1:q0", 2)
    (mine,) = q.claim("a", 1, "live-worker", 30)
    assert mine.attempts == 3
    q.r.zadd(keys.inflight("a"), {mine.query.gid: 0}, xx=True)  # the outage outlasted its lease
    assert q.requeue_expired("a") == 1  # Redis is back: the offloader requeues before the worker renews
    assert q.batch("b1").failed == 0 and q.results("b1") == []
    if how == "claim":
        (other,) = q.claim("a", 1, "live-worker", 30, renew=[mine.query.gid])
        assert other.query.gid == "b1:q1"
    else:
        assert q.renew("a", [mine.query.gid], 30, worker_id="live-worker") == 1
    assert mine.query.gid in q.inflight_ids("a") and "b1:q0" not in q.queued_ids("a")
    assert q.complete(mine.query.gid, {"query_id": "q0", "text": "real"}, "completed", 3) == 0
    (row,) = q.results("b1")
    assert row["text"] == "real"
    info = q.batch("b1")
    assert (info.completed, info.failed) == (1, 0)
    assert check(q.r) == []


def test_a_poison_query_moved_to_another_cluster_fails_at_its_claim_there(redis_url):
    """A dead cluster's poison query, requeued and then evacuated, still gives up at its next claim."""
    q = make_queue(redis_url)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 2)])
    q.register_cluster("b")
    lapse_after_crashes(q, "b1:q0", 3)
    assert q.move_tail("a", "b", 2) == (2, 20.0)
    (c,) = q.claim("b", 5, "w-b", 30)
    assert c.query.gid == "b1:q1"
    (row,) = q.results("b1")
    assert row["query_id"] == "q0" and row["cluster"] == "b" and "failed 3 times" in row["error"]
    assert q.queued_ids("b") == [] and abs(pending(q, "b")) < 1e-6
    assert check(q.r) == []


def test_max_attempts_is_configurable_and_counts_released_queries(redis_url):
    q = make_queue(redis_url, max_attempts=1)
    assert q.max_attempts == 1
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 1)])
    (c,) = q.claim("a", 1, "w", 30)
    assert q.release("a", [c.query.gid], worker="w") == 1  # given back by a failing engine: queued again
    assert q.claim("a", 1, "w2", 30) == []  # no attempt left: it fails at its next claim
    info = q.batch("b1")
    assert (info.status, info.failed) == ("failed", 1)
    assert "failed 1 time " in q.results("b1")[0]["error"]
    assert q.queued_ids("a") == [] and query_keys(q) == []
    assert abs(pending(q, "a")) < 1e-6


def test_without_a_limit_a_query_is_claimed_again_and_again(redis_url):
    q = make_queue(redis_url, max_attempts=None)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 1)])
    lapse_after_crashes(q, "b1:q0", 5)
    (c,) = q.claim("a", 1, "w", 30)
    assert c.attempts == 6 and q.results("b1") == []
