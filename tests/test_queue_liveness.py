"""Liveness gates new work: a cluster with no live heartbeat gets none while some cluster is alive."""

from __future__ import annotations

import grpc
import pytest

from gateway.config import ClusterSpec, GatewayConfig
from gateway.offload.offloader import OffloadConfig, Offloader
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread
from workqueue import QueuedQuery, WorkQueue, connect


@pytest.fixture
def gateway(redis_url):
    config = GatewayConfig(
        redis_url=redis_url,
        policy="token",
        offload=False,
        clusters=[ClusterSpec(n, capacity_tps=100) for n in ("a", "b", "ghost")],
    )
    g = GatewayThread(config)
    address = g.start()
    channel = grpc.insecure_channel(address)
    yield pb_grpc.BatchServiceStub(channel), WorkQueue(connect(redis_url))
    channel.close()
    g.stop()


def batch_of(n: int, batch_id: str) -> pb.SubmitBatchRequest:
    req = pb.SubmitBatchRequest(batch_id=batch_id)
    for i in range(n):
        req.queries.add(id=f"q{i}", prompt=f"Explain topic number {i}.", max_tokens=8)
    return req


def test_a_cluster_with_no_engine_gets_no_work_while_others_are_alive(gateway):
    client, queue = gateway
    for name in ("a", "b"):
        queue.heartbeat(name, ttl_s=60, tokens_per_s=100)
    batch = client.SubmitBatch(batch_of(60, "live"))
    assert batch.queries_per_cluster.get("ghost", 0) == 0
    assert sum(batch.queries_per_cluster.values()) == 60
    assert queue.clusters(["ghost"])[0].queue_length == 0


def test_at_start_up_work_waits_and_then_goes_to_the_first_live_cluster(gateway):
    client, queue = gateway
    batch = client.SubmitBatch(batch_of(30, "early"))  # no engine alive yet: accepted, waits durably
    assert sum(batch.queries_per_cluster.values()) == 30
    queue.heartbeat("a", ttl_s=60, tokens_per_s=100)
    Offloader(queue).tick()  # a is alive now: b's and ghost's queues are evacuated to it
    by_name = {c.name: c for c in queue.clusters()}
    assert by_name["a"].queue_length == 30
    assert by_name["b"].queue_length == by_name["ghost"].queue_length == 0
    assert by_name["b"].pending_tokens == by_name["ghost"].pending_tokens == 0


def test_evacuation_reads_and_moves_a_bounded_chunk_per_tick(redis_url):
    queue = WorkQueue(connect(redis_url))
    queue.register_cluster("a", capacity_hint_tps=100)
    queue.register_cluster("gone", capacity_hint_tps=100)
    queue.heartbeat("a", ttl_s=60, tokens_per_s=100)
    rows = [(QueuedQuery("b", f"q{i}", "p", 8, 4, 10.0), "gone") for i in range(500)]
    queue.create_batch("b", rows)
    offloader = Offloader(queue, OffloadConfig(evacuate_chunk=200))
    left = []
    for _ in range(3):
        offloader.tick()
        left.append(queue.clusters(["gone"])[0].queue_length)
    assert left == [300, 100, 0]
    moved = queue.queued_ids("a")  # chunks leave from the back; each query keeps its place in the order
    assert moved == [f"b:q{i}" for i in range(500)]
    assert queue.clusters(["a"])[0].pending_tokens == 500 * 14
