"""The Redis queue layer against a real Redis server: reliable consume, requeue, write-once results."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workqueue import QueuedQuery, WorkQueue, connect, keys
from workqueue.wake import WakeListener


def make_queue(url: str) -> WorkQueue:
    return WorkQueue(connect(url))


def queries(batch: str, n: int, tokens: float = 10.0) -> list[QueuedQuery]:
    return [QueuedQuery(batch, f"q{i}", f"prompt {i}", 16, 4, tokens - 4) for i in range(n)]


def test_create_claim_complete_roundtrip(redis_url):
    q = make_queue(redis_url)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 3)], policy="round_robin")
    assert q.batch("b1").status == "in_progress"
    assert q.clusters(["a"])[0].pending_tokens == pytest.approx(30.0)
    claimed = q.claim("a", 2, "w1", lease_s=30)
    assert [c.query.query_id for c in claimed] == ["q0", "q1"]
    assert [c.attempts for c in claimed] == [1, 1]
    assert q.clusters(["a"])[0].pending_tokens == pytest.approx(10.0)
    assert q.inflight_ids("a") == ["b1:q0", "b1:q1"]
    assert q.complete("b1:q0", {"query_id": "q0", "text": "x"}, "completed", 5) == 0
    assert q.complete("b1:q1", {"query_id": "q1"}, "failed") == 1
    assert q.inflight_ids("a") == []
    info = q.batch("b1")
    assert (info.completed, info.failed, info.status) == (1, 1, "in_progress")
    (last,) = q.claim("a", 5, "w1", lease_s=30)
    q.complete(last.query.gid, {"query_id": "q2"}, "completed", 7)
    info = q.batch("b1")
    assert info.status == "completed" and info.completed_at > 0
    stats = q.clusters(["a"])[0]
    assert stats.finished_actual_tokens == 12 and stats.finished_queries == 2


def test_duplicate_batch_id_changes_nothing(redis_url):
    q = make_queue(redis_url)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 2)])
    assert not q.create_batch("b1", [(x, "b") for x in queries("b1", 5)])
    assert q.batch("b1").total == 2
    assert q.queued_ids("b") == []


def test_results_are_written_once(redis_url):
    q = make_queue(redis_url)
    q.create_batch("b1", [(x, "a") for x in queries("b1", 1)])
    (c,) = q.claim("a", 1, "w1", 30)
    assert q.complete(c.query.gid, {"query_id": "q0", "text": "first"}) == 0
    assert q.complete(c.query.gid, {"query_id": "q0", "text": "second"}) == -1
    rows = q.results("b1")
    assert len(rows) == 1 and rows[0]["text"] == "first"
    assert q.batch("b1").completed == 1


def test_dead_worker_queries_are_requeued_at_the_head(redis_url):
    q = make_queue(redis_url)
    q.create_batch("b1", [(x, "a") for x in queries("b1", 4)])
    dead = q.claim("a", 2, "dead-worker", lease_s=0.05)
    live = q.claim("a", 1, "live-worker", lease_s=60)
    time.sleep(0.15)
    assert q.requeue_expired("a") == 2
    assert q.queued_ids("a") == ["b1:q0", "b1:q1", "b1:q3"]
    assert q.inflight_ids("a") == [live[0].query.gid]
    again = q.claim("a", 2, "w2", lease_s=60)
    assert [c.query.gid for c in again] == [c.query.gid for c in dead]
    assert [c.attempts for c in again] == [2, 2]


def test_renewed_lease_is_not_requeued(redis_url):
    q = make_queue(redis_url)
    q.create_batch("b1", [(x, "a") for x in queries("b1", 1)])
    (c,) = q.claim("a", 1, "w", lease_s=0.2)
    for _ in range(4):
        time.sleep(0.1)
        q.renew("a", [c.query.gid], lease_s=0.2)
        assert q.requeue_expired("a") == 0
    assert q.inflight_ids("a") == [c.query.gid]


def test_a_query_finished_by_a_slow_worker_is_not_requeued(redis_url):
    q = make_queue(redis_url)
    q.create_batch("b1", [(x, "a") for x in queries("b1", 1)])
    (c,) = q.claim("a", 1, "w", lease_s=0.05)
    q.complete(c.query.gid, {"query_id": "q0"})
    time.sleep(0.1)
    assert q.requeue_expired("a") == 0
    assert q.queued_ids("a") == []


def test_move_tail_moves_the_back_in_order(redis_url):
    q = make_queue(redis_url)
    q.create_batch("b1", [(x, "a") for x in queries("b1", 5)])
    moved, tokens = q.move_tail("a", "b", 2)
    assert (moved, tokens) == (2, 20.0)
    assert q.queued_ids("a") == ["b1:q0", "b1:q1", "b1:q2"]
    assert q.queued_ids("b") == ["b1:q3", "b1:q4"]
    a, b = q.clusters(["a", "b"])
    assert (a.pending_tokens, b.pending_tokens) == (30.0, 20.0)
    assert q.move_tail("a", "b", 10)[0] == 3
    assert q.queued_ids("a") == []
    assert q.queued_ids("b") == [
        f"b1:q{i}" for i in range(5)
    ]  # each moved query keeps its place in the order
    (c,) = q.claim("b", 1, "w", 30)
    assert c.query.gid == "b1:q0"


def test_cancel_removes_queued_and_finishes_batch(redis_url):
    q = make_queue(redis_url)
    q.create_batch("b1", [(x, "a" if i % 2 else "b") for i, x in enumerate(queries("b1", 4))])
    q.create_batch("b2", [(x, "a") for x in queries("b2", 2)])
    (running,) = q.claim("b", 1, "w", 30)
    assert q.cancel_batch("b1") == 3
    info = q.batch("b1")
    assert info.status == "cancelling" and info.cancelled == 3
    assert q.queued_ids("a") == ["b2:q0", "b2:q1"]
    q.complete(
        running.query.gid, {"query_id": running.query.query_id, "finish_reason": "cancelled"}, "cancelled"
    )
    assert q.batch("b1").status == "cancelled"
    assert q.cancel_batch("b1") == 0
    assert q.cancel_batch("nope") == -1


def test_claim_skips_queries_of_a_cancelling_batch(redis_url):
    q = make_queue(redis_url)
    q.create_batch("b1", [(x, "a") for x in queries("b1", 2)])
    q.r.hset(keys.batch("b1"), "status", "cancelling")  # as if cancelled between two claims
    assert q.claim("a", 5, "w", 30) == []
    assert q.batch("b1").status == "cancelled"
    assert {r["finish_reason"] for r in q.results("b1")} == {"cancelled"}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(min_value=1, max_value=120),
    moves=st.lists(
        st.tuples(st.sampled_from("abc"), st.sampled_from("abc"), st.integers(1, 20)), max_size=25
    ),
)
def test_offloading_under_concurrent_consumers_never_loses_or_duplicates(redis_url, n, moves):
    """Consumers on three clusters claim and complete while another thread moves queue tails around."""
    import redis as redis_lib

    redis_lib.Redis.from_url(redis_url).flushall()
    q = make_queue(redis_url)
    q.create_batch("b", [(x, "abc"[i % 3]) for i, x in enumerate(queries("b", n))])
    seen: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def consume(cluster: str) -> None:
        wq = make_queue(redis_url)
        while not stop.is_set():
            got = wq.claim(cluster, 3, f"w-{cluster}", 30)
            for c in got:
                with lock:
                    seen.append(c.query.gid)
                wq.complete(c.query.gid, {"query_id": c.query.query_id})
            if not got:
                if wq.batch("b").final:
                    return
                time.sleep(0.001)

    def mover() -> None:
        wq = make_queue(redis_url)
        for src, dst, k in moves:
            wq.move_tail(src, dst, k)

    threads = [threading.Thread(target=consume, args=(c,)) for c in "abc"] + [threading.Thread(target=mover)]
    for t in threads:
        t.start()
    threads[-1].join()
    for t in threads[:-1]:
        t.join(timeout=30)
    stop.set()
    assert sorted(seen) == sorted(f"b:q{i}" for i in range(n)), "a query was lost or claimed twice"
    info = q.batch("b")
    assert info.status == "completed" and info.completed == n
    assert len(q.results("b")) == n
    for c in "abc":
        assert q.queued_ids(c) == [] and q.inflight_ids(c) == []


def test_idle_engines_are_woken_when_work_lands_in_their_queue(redis_url):
    q = make_queue(redis_url)
    a, b = q.wake_listener("a"), q.wake_listener("b")
    try:
        assert not a.wait(0.05) and not b.wait(0.05)  # subscribed; nothing announced yet
        q.create_batch("b1", [(x, "a") for x in queries("b1", 3)])
        assert a.wait(30)  # woken at once (the 30 s is only a bound)
        assert not b.wait(0.05)  # only the clusters that got queries
        # everything announced while a worker was busy ends one wait, not one per message
        q.create_batch("b2", [(x, "a") for x in queries("b2", 1)])
        q.create_batch("b3", [(x, "a") for x in queries("b3", 1)])
        time.sleep(0.2)
        assert a.wait(30) and not a.wait(0.05)
        # the mover's moves wake the receiving cluster
        assert q.move_tail("a", "b", 2)[0] == 2
        assert b.wait(30) and not a.wait(0.05)
        # the background intake's chunks too
        row = QueuedQuery("b4", "q0", "hello", 4, 1, 4.0)
        assert q.accept_batch("b4", ["{}"]) and q.take_intake("b4", "me", 30)
        assert q.enqueue_chunk("b4", "me", 0, [(row.gid, json.dumps(asdict(row)), 5.0, "b")], 30) == 1
        assert b.wait(30)
    finally:
        a.close()
        b.close()


def test_a_listener_without_redis_times_out_like_the_poll_it_replaces():
    client = redis.Redis.from_url("redis://127.0.0.1:1/0")  # nothing listens there
    listener = WakeListener(client, "a")
    assert not listener.wait(0.2)
    assert not listener.wait(0.2)  # and again: it retries the subscription, still no error


def test_a_removed_cluster_claims_nothing_new_but_keeps_its_leases(redis_url):
    """From the moment a cluster is marked removed its worker takes nothing more from the queue (the
    movers empty it), though it keeps renewing what it runs: no window in which the worker, which
    checks the state only now and then, takes work its removal was to move away."""
    q = make_queue(redis_url)
    q.create_batch("b1", [(x, "a") for x in queries("b1", 3)], policy="round_robin")
    (first,) = q.claim("a", 1, "w1", lease_s=30)
    q.set_cluster_state("a", "removed")
    assert q.claim("a", 5, "w1", lease_s=30, renew=[first.query.gid]) == []
    assert q.queued_ids("a") == ["b1:q1", "b1:q2"] and q.inflight_ids("a") == ["b1:q0"]
    q.set_cluster_state("a", "active")  # re-added: claims again
    assert [c.query.query_id for c in q.claim("a", 5, "w1", lease_s=30)] == ["q1", "q2"]
