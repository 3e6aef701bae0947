"""Fit checks of moves use a row's full size (issue 48, finding 4).

A row's ``tokens`` is its charge on its cluster: prompt + predicted response less the prompt tokens
that cluster's prefix cache is expected to hold (up to 2,048 below its real size). The offloader,
rebalance and a removed cluster's evacuation check fit against the full size, which the query hash
keeps beside ``tokens``, and a moved row is charged its full size on the recipient (whose cache does
not hold its prefix). Real Redis; the recipient ``a`` has a 100-token limit per query.
"""

from __future__ import annotations

import pytest

from gateway.assign.views import queued_loads
from gateway.intake.rows import payload
from gateway.offload.offloader import Offloader
from tests.harness import accept
from workqueue import QueuedQuery, WorkQueue, connect, keys
from workqueue.invariants import check


def small(i: int) -> QueuedQuery:
    """14 tokens: fits everywhere."""
    return QueuedQuery("b", f"q{i}", "p", 8, 4, 10.0)


def wide(qid: str = "wide") -> QueuedQuery:
    """130 tokens (80 prompt + 50 predicted), charged 70: 60 prompt tokens in its cluster's prefix cache."""
    return QueuedQuery("b", qid, "p", 8, 80, 50.0, cached_tokens=60)


def fleet(queue: WorkQueue, big_state: str = "active") -> None:
    """``a`` (limit 100 tokens a query) and ``big`` (no limit), both alive."""
    queue.register_cluster("a", capacity_hint_tps=100, max_query_tokens=100)
    queue.register_cluster("big", capacity_hint_tps=100)
    for name in ("a", "big"):
        queue.heartbeat(name, ttl_s=60, tokens_per_s=100)
    if big_state != "active":
        queue.set_cluster_state("big", big_state)


def test_evacuation_keeps_a_row_whose_charge_fits_the_recipient_but_whose_full_size_does_not(redis_url):
    queue = WorkQueue(connect(redis_url))
    fleet(queue, big_state="draining")
    queue.create_batch("b", [(small(0), "big"), (wide(), "big"), (small(1), "big")])
    Offloader(queue).tick()
    assert queue.queued_ids("big") == ["b:wide"], "a row larger than a's limit was moved to a"
    assert queue.queued_ids("a") == ["b:q0", "b:q1"]
    assert check(queue.r) == []


def test_offloading_to_an_idle_cluster_does_not_take_a_row_only_its_charge_fits(redis_url):
    queue = WorkQueue(connect(redis_url))
    fleet(queue)
    rows = [(QueuedQuery("b", f"q{i}", "p", 8, 4, 96.0), "big") for i in range(50)] + [(wide(), "big")]
    queue.create_batch("b", rows)
    Offloader(queue).tick()
    assert "b:wide" not in queue.queued_ids("a"), "a row larger than a's limit was moved to a"
    assert queue.queued_ids("big")[-1] == "b:wide"
    assert check(queue.r) == []


def test_a_removed_clusters_row_whose_full_size_fits_no_active_cluster_is_failed_not_moved(redis_url):
    queue = WorkQueue(connect(redis_url))
    fleet(queue, big_state="removed")
    queue.create_batch("b", [(small(0), "big"), (wide(), "big")])
    Offloader(queue).tick()
    assert queue.queued_ids("big") == [] and queue.queued_ids("a") == ["b:q0"]
    (row,) = queue.results("b")
    assert row["query_id"] == "wide" and "fits on no other active cluster" in row["error"]
    assert check(queue.r) == []


def test_a_moved_row_is_charged_its_full_size_on_the_recipient(redis_url):
    queue = WorkQueue(connect(redis_url))
    for name in ("src", "dst"):
        queue.register_cluster(name, capacity_hint_tps=100)
    queue.create_batch("b", [(wide(), "src"), (small(0), "src")])
    assert queue.clusters(["src"])[0].pending_tokens == 70 + 14
    assert queue.move_ids("src", "dst", ["b:wide"]) == (1, 130.0)
    src, dst = queue.clusters(["src", "dst"])
    assert (src.pending_tokens, dst.pending_tokens) == (14, 130)
    assert (src.assigned_predicted_tokens, dst.assigned_predicted_tokens) == (14, 130)
    assert queue.batch("b").left_tokens_per_cluster == {"src": 14, "dst": 130}
    assert float(queue.r.hget(keys.query("b:wide"), "tokens")) == 130
    assert check(queue.r) == []
    # it runs there and finishes: every counter it was charged to comes back to zero
    (claimed,) = queue.claim("dst", 1, "w", lease_s=60)
    assert queue.clusters(["dst"])[0].pending_tokens == 0
    queue.complete(claimed.query.gid, {"batch_id": "b", "query_id": "wide", "finish_reason": "stop"})
    assert queue.batch("b").left_tokens_per_cluster == {"src": 14}
    assert check(queue.r) == []


def test_a_row_moved_twice_is_charged_its_full_size_once(redis_url):
    queue = WorkQueue(connect(redis_url))
    for name in ("src", "dst"):
        queue.register_cluster(name, capacity_hint_tps=100)
    queue.create_batch("b", [(wide(), "src")])
    assert queue.move_ids("src", "dst", ["b:wide"]) == (1, 130.0)
    assert queue.move_ids("dst", "src", ["b:wide"]) == (1, 130.0)
    src, dst = queue.clusters(["src", "dst"])
    assert (src.pending_tokens, dst.pending_tokens) == (130, 0)
    assert check(queue.r) == []


def test_the_movers_read_the_full_size_and_an_older_row_falls_back_to_its_tokens(redis_url):
    queue = WorkQueue(connect(redis_url))
    queue.register_cluster("big", capacity_hint_tps=100)
    queue.create_batch("b", [(wide(), "big"), (wide("old"), "big")])
    queue.r.hdel(keys.query("b:old"), keys.FULL_TOKENS)  # written before the field existed
    assert [(q.key, q.total_tokens) for q in queued_loads(queue, "big")] == [("b:wide", 130), ("b:old", 70)]
    assert queue.tails({"big": (2, 0)}) == {"big": [("b:wide", 130.0), ("b:old", 70.0)]}
    queue.register_cluster("dst", capacity_hint_tps=100)
    assert queue.move_ids("big", "dst", ["b:old"]) == (1, 70.0)  # an older row moves at its charge
    assert check(queue.r) == []


@pytest.mark.parametrize("cached", [0, 60])
def test_a_row_landed_by_the_background_intake_keeps_its_full_size(redis_url, cached):
    queue = WorkQueue(connect(redis_url))
    queue.register_cluster("big", capacity_hint_tps=100)
    accept(queue, "x", 1, prompt_tokens=80)
    row = {
        "id": "q0",
        "prompt": "x 0",
        "max_tokens": 8,
        "prompt_tokens": 80,
        "temperature": 0.0,
        "top_p": 1.0,
    }
    assert queue.take_intake("x", "tok", ttl_s=30)
    land = [(keys.gid("x", "q0"), payload("x", row, 50.5, cached), 130.5 - cached, "big")]
    assert queue.enqueue_chunk("x", "tok", 0, land, ttl_s=30) == 1
    h = queue.r.hmget(keys.query("x:q0"), "tokens", keys.FULL_TOKENS)
    assert [float(v) for v in h] == [130.5 - cached, 130.5]
    assert [q.total_tokens for q in queued_loads(queue, "big")] == [130.5]
    assert check(queue.r) == []
