"""End to end: the real gateway, real engine processes, a real Redis, real prompts from ../shared/data."""

from __future__ import annotations

import signal
from collections import Counter

import grpc
import pytest

from gateway.config import ClusterSpec, GatewayConfig
from load.client import run_batch, to_request
from load.workload import from_dataset
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, start_engine, wait_until
from workqueue import WorkQueue, connect

ENGINE_ARGS = (
    "--backend",
    "static",
    "--size",
    "nano",
    "--max-running",
    "4",
    "--lease-s",
    "3",
    "--heartbeat-s",
    "0.3",
)


@pytest.fixture
def deployment(redis_url, tmp_path):
    config = GatewayConfig(
        redis_url=redis_url,
        policy="token",
        offload_interval_s=0.2,
        clusters=[ClusterSpec("east", capacity_tps=100), ClusterSpec("west", capacity_tps=100)],
    )
    engines = {c: start_engine(c, redis_url, tmp_path, *ENGINE_ARGS) for c in ("east", "west")}
    gateway = GatewayThread(config)
    address = gateway.start()
    queue = WorkQueue(connect(redis_url))
    try:
        wait_until(lambda: all(c.alive for c in queue.clusters(["east", "west"])), 240, "engine heartbeats")
        yield address, engines, queue
    finally:
        gateway.stop()
        for p in engines.values():
            if p.poll() is None:
                p.terminate()
        for p in engines.values():
            p.wait(timeout=30)


def test_thirty_real_queries_come_back_exactly_once(deployment, data_root):
    address, _, queue = deployment
    items = from_dataset("mixed", 30, seed=3, max_tokens=24, forced=True)
    batch, results, _ = run_batch(address, items, progress=False, timeout_s=300)
    assert batch.status == pb.COMPLETED
    assert batch.request_counts.completed == 30
    counts = Counter(r["query_id"] for r in results)
    assert sorted(counts) == sorted(i.id for i in items) and set(counts.values()) == {1}
    forced = {i.id: i.forced_length for i in items}
    assert all(int(r["completion_tokens"]) == forced[r["query_id"]] for r in results), (
        "forced length not honoured"
    )
    assert {r["cluster"] for r in results} == {"east", "west"}
    finished = {c.name: c.finished_queries for c in queue.clusters(["east", "west"])}
    assert sum(finished.values()) == 30


def busy_cluster(queue: WorkQueue) -> str | None:
    """A cluster running queries now, if any."""
    return next((c.name for c in queue.clusters(["east", "west"]) if c.inflight > 0), None)


def test_a_killed_engine_loses_no_query(deployment, data_root):
    """SIGKILL an engine mid-batch: its leases expire, its queries run elsewhere, each result once.

    The engine killed is one seen running queries (the offloader may hand an idle engine's
    whole queue to the other before it claims any, so waiting on one named cluster could wait
    for nothing)."""
    address, engines, queue = deployment
    items = from_dataset("mixed", 24, seed=5, max_tokens=48, forced=True)
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.BatchServiceStub(ch)
        batch = stub.SubmitBatch(to_request(items))
        wait_until(lambda: busy_cluster(queue) is not None, 120, "an engine to start work", 0.05)
        victim = busy_cluster(queue) or "east"
        survivor = "west" if victim == "east" else "east"
        engines[victim].send_signal(signal.SIGKILL)
        results = list(
            stub.StreamResults(pb.StreamResultsRequest(batch_id=batch.id, follow=True), timeout=300)
        )
        final = stub.GetBatch(pb.GetBatchRequest(batch_id=batch.id))
    assert final.status == pb.COMPLETED and final.request_counts.completed == 24
    counts = Counter(r.query_id for r in results)
    assert len(counts) == 24 and set(counts.values()) == {1}
    assert any(r.attempts > 1 for r in results), "no query was retried after the kill"
    assert all(r.cluster == survivor for r in results if r.attempts > 1)
