"""The gateway's ticks make as many Redis round trips with many clusters or batches as with few.

Counted on a real Redis (:func:`workqueue.roundtrips.count_round_trips`: a command or a whole
pipeline is one), which is deterministic: the offloader's tick, with every cluster busy or with
idle clusters that each take work; the per-client cap's read of a client's batches; the HTTP
front's batch listing; the cluster status (``ListClusters``, ``fleetbatch gateway status``).
"""

from __future__ import annotations

import json
from dataclasses import asdict

from gateway.assign.listing import read_clusters
from gateway.batches import quota
from gateway.grpc_api.auth import HTTP_CLIENT
from gateway.http_api import batches as ob
from gateway.offload.offloader import Offloader
from workqueue import QueuedQuery, WorkQueue, connect
from workqueue.invariants import check
from workqueue.roundtrips import count_round_trips


def alive(q: WorkQueue, names: list[str]) -> None:
    for n in names:
        q.register_cluster(n, capacity_hint_tps=100)
        q.heartbeat(n, 600, tokens_per_s=100, running=0)


def queued(q: WorkQueue, batch_id: str, cluster: str, n: int) -> None:
    q.create_batch(
        batch_id, [(QueuedQuery(batch_id, f"q{i}", "p", 200, 10, 100.0), cluster) for i in range(n)]
    )


def counted(url: str) -> tuple[WorkQueue, object]:
    q = WorkQueue(connect(url))
    trips = count_round_trips(q.r)
    q.r.ping()  # connection set-up counted here, not in what is measured
    return q, trips


def offloader_tick(url: str, k: int, idle: bool) -> int:
    """Round trips of one tick with ``k`` clusters: all busy, or ``c0`` busy and the rest idle."""
    setup = WorkQueue(connect(url))
    names = [f"c{i}" for i in range(k)]
    q, trips = counted(url)
    for warm_up in (True, False):  # after the warm-up Redis has the scripts
        setup.r.flushall()
        alive(setup, names)
        for i, n in enumerate(names[:1] if idle else names):
            queued(setup, f"b{i}", n, 300 * k if idle else 5)  # each idle cluster takes a whole tail
        if warm_up:
            Offloader(q).tick()
    before = trips.value
    moved = Offloader(q).tick()
    n = trips.value - before
    if idle:
        assert moved > 0
        assert all(setup.clusters([c])[0].queue_length > 0 for c in names[1:]), "an idle cluster got nothing"
    else:
        assert moved == 0
    assert check(setup.r) == []
    return n


def test_an_offloader_tick_with_busy_clusters_costs_the_same_round_trips_for_2_and_8(redis_url):
    assert offloader_tick(redis_url, 8, idle=False) == offloader_tick(redis_url, 2, idle=False)


def test_an_offloader_tick_moving_work_to_7_idle_clusters_costs_what_it_costs_for_1(redis_url):
    few, many = offloader_tick(redis_url, 2, idle=True), offloader_tick(redis_url, 8, idle=True)
    assert many == few


def batches(url: str, b: int) -> WorkQueue:
    setup = WorkQueue(connect(url))
    setup.r.flushall()
    alive(setup, ["c0"])
    for i in range(b):
        queued(setup, f"h{i}", "c0", 2)
        ob.create_record(setup, f"h{i}", "file-x", "/v1/chat/completions", "24h")
        setup.r.sadd(quota.client_key("alice"), f"h{i}")
    return setup


def quota_check(url: str, b: int) -> int:
    """Round trips of the per-client cap's check over ``b`` unfinished batches of the client."""
    batches(url, b)
    q, trips = counted(url)
    before = trips.value
    assert quota.unfinished(q, "alice") == 2 * b
    return trips.value - before


def test_the_per_client_cap_check_costs_the_same_round_trips_for_1_and_12_batches(redis_url):
    assert quota_check(redis_url, 12) == quota_check(redis_url, 1)


def listing(url: str, b: int) -> int:
    """Round trips of the HTTP front's batch listing (``GET /v1/batches``) of ``b`` batches."""
    batches(url, b)
    q, trips = counted(url)
    ids, _ = ob.list_batches(q, 100, None)
    objects = ob.batch_objects(q, ids, HTTP_CLIENT)  # notes each batch's in-progress time, once
    assert sorted(o["id"] for o in objects.values()) == sorted(f"h{i}" for i in range(b))
    before = trips.value
    ob.batch_objects(q, ob.list_batches(q, 100, None)[0], HTTP_CLIENT)
    return trips.value - before


def test_the_http_batch_listing_costs_the_same_round_trips_for_1_and_12_batches(redis_url):
    assert listing(redis_url, 12) == listing(redis_url, 1)


def test_the_cluster_status_costs_the_same_round_trips_for_2_and_12_clusters(redis_url):
    def status(k: int) -> int:
        setup = WorkQueue(connect(redis_url))
        setup.r.flushall()
        alive(setup, [f"c{i}" for i in range(k)])
        q, trips = counted(redis_url)
        before = trips.value
        assert len(read_clusters(q, listed=True)) == k
        return trips.value - before

    assert status(12) == status(2)


def test_a_chunks_parts_land_in_one_round_trip_and_none_after_a_refused_one(redis_url):
    """The intake's 1,000-row script calls go in one pipeline: each still checks the lease and the
    cursor, so parts landed already or sent without the lease are refused, and nothing lands twice."""
    q, trips = counted(redis_url)
    alive(q, ["a", "b"])
    rows = [json.dumps({"id": f"q{i}"}) for i in range(6)]
    assert q.accept_batch("big", rows) and q.take_intake("big", "me", 30)

    def part(lo: int, hi: int) -> list[tuple[str, str, float, str]]:
        out = []
        for i in range(lo, hi):
            row = QueuedQuery("big", f"q{i}", "p", 4, 1, 4.0)
            out.append((row.gid, json.dumps(asdict(row)), 5.0, "ab"[i % 2]))
        return out

    assert q.enqueue_parts("big", "other", 0, [part(0, 2)], 30) == [-1]  # not its lease (the script loads)
    before = trips.value
    assert q.enqueue_parts("big", "me", 0, [part(0, 2), part(2, 4)], 30) == [2, 2]
    assert trips.value - before == 2  # the parts, then the wake-ups of both clusters
    assert q.enqueue_parts("big", "me", 0, [part(0, 2), part(2, 4)], 30) == [-3, -3]  # landed already
    assert q.queued_ids("a") + q.queued_ids("b") == ["big:q0", "big:q2", "big:q1", "big:q3"]
    assert q.enqueue_parts("big", "me", 4, [part(4, 5), part(5, 6)], 30) == [1, 1]
    assert sorted(q.queued_ids("a") + q.queued_ids("b")) == [f"big:q{i}" for i in range(6)]
    assert check(q.r) == []
