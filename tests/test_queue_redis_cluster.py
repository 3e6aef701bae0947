"""R6: the queue on a real three-node Redis Cluster: one key schema with the ``{fb}`` hash tag,
scripts called with their keys, so claims, leases, moves, cancel and the mover lease work there."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess

import pytest
import redis

from tests.harness import wait_until
from workqueue import QueuedQuery, WorkQueue, connect, keys
from workqueue.embedded import find_redis_server
from workqueue.invariants import check
from workqueue.records import QueryResult, QueryState
from workqueue.roundtrips import count_round_trips
from workqueue.worker_tick import Finished, TickRequest, run_tick

REDIS_CLI = shutil.which("redis-cli", path="/usr/bin:/usr/local/bin") or shutil.which("redis-cli")


@pytest.fixture
def cluster_url(tmp_path):
    if REDIS_CLI is None:
        pytest.skip("redis-cli is needed to form a cluster")
    server = find_redis_server()
    ports, procs = free_ports(3), []
    for i in range(3):
        d = tmp_path / f"node{i}"
        d.mkdir()
        procs.append(
            subprocess.Popen(
                [
                    server,
                    "--port",
                    str(ports[i]),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(d / "nodes.conf"),
                    "--dir",
                    str(d),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ],  # fmt: skip
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    try:
        for p in ports:
            wait_until(lambda p=p: _pings(p), 20, f"cluster node on {p}")
        subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in ports],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],  # fmt: skip
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_until(lambda: _cluster_ok(ports[0]), 30, "the cluster to be ok")
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        for p in procs:
            p.kill()
            p.wait()


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports whose cluster-bus ports (port + 10000) are free too."""
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        p = rng.randrange(20000, 30000)
        if p in ports:
            continue
        try:
            for q in (p, p + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
        except OSError:
            continue
        ports.append(p)
    return ports


def _pings(port: int) -> bool:
    try:
        return redis.Redis(port=port).ping()
    except redis.ConnectionError:
        return False


def _cluster_ok(port: int) -> bool:
    return redis.Redis(port=port, decode_responses=True).cluster("info").get("cluster_state") == "ok"


def test_the_queue_works_on_a_redis_cluster(cluster_url):
    q = WorkQueue(connect(cluster_url))
    assert isinstance(q.r, redis.cluster.RedisCluster)
    for name in ("a", "b"):
        q.register_cluster(name, capacity_hint_tps=100)
        q.heartbeat(name, ttl_s=60, tokens_per_s=100)
    rows = [(QueuedQuery("x", f"q{i}", "p", 8, 4, 6.0), "a") for i in range(20)]
    idle_a, idle_b = q.wake_listener("a"), q.wake_listener("b")
    assert not idle_a.wait(0.05)
    assert q.create_batch("x", rows) and not q.create_batch("x", rows)
    assert idle_a.wait(30)  # idle engines are woken on a cluster too
    assert q.move_tail("a", "b", 5) == (5, 50.0)
    assert idle_b.wait(30)
    idle_a.close()
    idle_b.close()
    claimed = q.claim("a", 4, "w1", 30)
    assert len(claimed) == 4 and q.renew("a", [c.query.gid for c in claimed], 30) == 4
    for c in claimed[:3]:
        assert q.complete(c.query.gid, {"query_id": c.query.query_id}, "completed", 3) >= 0
    assert q.release("a", [claimed[3].query.gid], worker="w1") == 1
    with q.mover_lease("test") as held:
        assert held
    assert q.cancel_batch("x") == 17
    assert q.batch("x").status == "cancelled" and q.batch("x").completed == 3
    assert check(q.r) == []
    slots = {q.r.keyslot(k) for k in (keys.queue("a"), keys.query("x:q0"), keys.batch("x"), keys.MOVER)}
    assert len(slots) == 1  # one hash tag: one slot


def test_a_workers_tick_is_one_round_trip_on_a_redis_cluster(cluster_url):
    """Issue 33: the queue agent's tick (results, renewals, requeue, claim, statuses, heartbeat) runs
    as one pipeline of EVALSHA and commands on a cluster too, loading its scripts when they are missing."""
    q = WorkQueue(connect(cluster_url))
    assert q.create_batch("y", [(QueuedQuery("y", f"q{i}", "p", 8, 4, 6.0), "a") for i in range(6)])
    first = run_tick(q, TickRequest("a", "w1", 30, register={"backend": "native"}, claim=2))
    assert [c.query.gid for c in first.claimed] == ["y:q0", "y:q1"] and first.state == "active"
    done = [
        Finished(c.query.gid, QueryResult("y", c.query.query_id, text="ok"), QueryState.COMPLETED, 2)
        for c in first.claimed
    ]
    trips = count_round_trips(q.r)
    q.r.ping()  # connections opened (their set-up costs round trips of its own)
    before = trips.value
    second = run_tick(
        q,
        TickRequest(
            "a",
            "w1",
            30,
            results=done,
            renew=["y:q0", "y:q1"],
            requeue=True,
            claim=2,
            batches=["y"],
            heartbeat={"running": 1},
            heartbeat_ttl_s=5,
        ),  # fmt: skip
    )
    assert second.written == [0, 1] and second.renewed == 0 and len(second.claimed) == 2
    assert second.statuses == {"y": "in_progress"}
    assert trips.value - before >= 2  # scripts missing: sent again once loaded
    before = trips.value
    later = [
        Finished(c.query.gid, QueryResult("y", c.query.query_id), QueryState.COMPLETED, 2)
        for c in second.claimed
    ]
    third = run_tick(
        q, TickRequest("a", "w1", 30, results=later, requeue=True, claim=2, heartbeat={"running": 0})
    )
    assert third.written == [2, 3] and len(third.claimed) == 2
    assert trips.value - before == 1  # the scripts are there now: one round trip
    assert q.batch("y").completed == 4 and q.clusters(["a"])[0].alive
    assert check(q.r) == []
