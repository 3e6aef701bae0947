"""The gRPC API against a real gateway on loopback and a real Redis: validation, states, cancel, admin."""

from __future__ import annotations

import threading

import grpc
import pytest

from gateway.config import ClusterSpec, GatewayConfig
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, batch_of
from workqueue import WorkQueue, connect, keys

TOKEN = "test-admin-token"


@pytest.fixture
def gateway(redis_url):
    config = GatewayConfig(
        redis_url=redis_url,
        admin_token=TOKEN,
        policy="round_robin",
        max_prompt_tokens=64,
        offload=False,
        clusters=[ClusterSpec("a", capacity_tps=100), ClusterSpec("b", capacity_tps=100)],
    )
    g = GatewayThread(config)
    address = g.start()
    channel = grpc.insecure_channel(address)
    yield (
        pb_grpc.BatchServiceStub(channel),
        pb_grpc.AdminServiceStub(channel),
        WorkQueue(connect(redis_url)),
        address,
    )
    channel.close()
    g.stop()


def invalid(stub, req) -> str:
    with pytest.raises(grpc.RpcError) as e:
        stub.SubmitBatch(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return e.value.details()


def test_bad_batches_are_rejected_and_nothing_is_enqueued(gateway):
    client, _, queue, _ = gateway
    assert "no queries" in invalid(client, pb.SubmitBatchRequest())
    req = batch_of(3)
    req.queries[1].prompt = "   "
    assert "query #1 ('q1'): empty prompt" in invalid(client, req)
    req = batch_of(3)
    req.queries[2].id = "q0"
    assert "duplicate id" in invalid(client, req)
    req = batch_of(2)
    req.queries[0].prompt = "word " * 500
    assert "limit is 64" in invalid(client, req)
    req = batch_of(2)
    req.queries[0].sampling.temperature = -1
    req.queries[1].sampling.top_p = 1.5
    details = invalid(client, req)
    assert "temperature" in details and "top_p" in details
    req = batch_of(1)
    req.queries[0].max_tokens = -3
    assert "max_tokens" in invalid(client, req)
    req = batch_of(1, batch_id="bad:id")
    assert "batch_id" in invalid(client, req)
    assert queue.r.keys(keys.query("*")) == [] and queue.r.keys(keys.batch("*")) == []
    assert all(c.queue_length == 0 for c in queue.clusters())


def test_unknown_batch_is_not_found(gateway):
    client, _, _, _ = gateway
    with pytest.raises(grpc.RpcError) as e:
        client.GetBatch(pb.GetBatchRequest(batch_id="nope"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_batch_runs_to_completion_through_a_real_worker(gateway, redis_url):
    """in_progress -> completed, with a real in-process worker and a small random model."""
    from engines.static_engine import StaticBatchEngine
    from engines.worker import Worker, WorkerConfig
    from localmodels import build_model, default_tokenizer

    client, _, _, _ = gateway
    batch = client.SubmitBatch(batch_of(6, batch_id="run-1"))
    assert batch.status == pb.IN_PROGRESS and batch.request_counts.total == 6
    assert dict(batch.queries_per_cluster) == {"a": 3, "b": 3}
    assert client.GetBatch(pb.GetBatchRequest(batch_id="run-1")).status == pb.IN_PROGRESS
    # the same batch id again is idempotent
    assert client.SubmitBatch(batch_of(6, batch_id="run-1")).id == "run-1"
    with pytest.raises(grpc.RpcError) as e:
        client.SubmitBatch(batch_of(2, batch_id="run-1"))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS

    tok = default_tokenizer()
    model = build_model("llama", "nano", tokenizer=tok)
    workers = [
        Worker(
            WorkQueue(connect(redis_url)), StaticBatchEngine(model, tok, max_batch=4), WorkerConfig(cluster=c)
        )
        for c in ("a", "b")
    ]
    threads = [threading.Thread(target=w.run, kwargs={"max_queries": 3}) for w in workers]
    for t in threads:
        t.start()
    results = list(client.StreamResults(pb.StreamResultsRequest(batch_id="run-1", follow=True), timeout=120))
    for t in threads:
        t.join(timeout=60)
    assert sorted(r.query_id for r in results) == [f"q{i}" for i in range(6)]
    assert all(1 <= r.completion_tokens <= 8 and r.cluster in ("a", "b") for r in results)
    assert [r.index for r in results] == list(range(6))
    final = client.GetBatch(pb.GetBatchRequest(batch_id="run-1"))
    assert final.status == pb.COMPLETED and final.request_counts.completed == 6
    resumed = list(client.StreamResults(pb.StreamResultsRequest(batch_id="run-1", start_index=4)))
    assert [r.index for r in resumed] == [4, 5]


def test_cancel_a_queued_batch(gateway):
    client, _, queue, _ = gateway
    batch = client.SubmitBatch(batch_of(5))
    after = client.CancelBatch(pb.CancelBatchRequest(batch_id=batch.id))
    assert after.status == pb.CANCELLED and after.request_counts.cancelled == 5
    results = list(client.StreamResults(pb.StreamResultsRequest(batch_id=batch.id, follow=True), timeout=10))
    assert {r.finish_reason for r in results} == {"cancelled"} and len(results) == 5
    assert all(c.queue_length == 0 for c in queue.clusters())


def test_admin_needs_the_token(gateway):
    _, admin, _, _ = gateway
    with pytest.raises(grpc.RpcError) as e:
        admin.Rebalance(pb.RebalanceRequest(dry_run=True))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        admin.Rebalance(pb.RebalanceRequest(dry_run=True), metadata=[("authorization", "Bearer wrong")])
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_rebalance_dry_run_then_apply_and_drain(gateway):
    client, admin, queue, _ = gateway
    md = [("authorization", f"Bearer {TOKEN}")]
    client.SubmitBatch(batch_of(8))
    queue.move_tail("b", "a", 4)  # everything on a: unbalanced
    assert [c.queue_length for c in queue.clusters(["a", "b"])] == [8, 0]
    plan = admin.Rebalance(pb.RebalanceRequest(dry_run=True), metadata=md)
    assert not plan.applied and sum(m.count for m in plan.moves) == 4
    assert [c.queue_length for c in queue.clusters(["a", "b"])] == [8, 0], "a dry run moved work"
    done = admin.Rebalance(pb.RebalanceRequest(dry_run=False), metadata=md)
    assert done.applied and sum(m.moved for m in done.moves) == 4
    assert [c.queue_length for c in queue.clusters(["a", "b"])] == [4, 4]
    drained = admin.DrainCluster(pb.DrainClusterRequest(name="b"), metadata=md)
    assert sum(m.moved for m in drained.moves) == 4
    a, b = queue.clusters(["a", "b"])
    assert (a.queue_length, b.queue_length, b.state) == (8, 0, "draining")
    # new batches avoid the draining cluster
    batch = client.SubmitBatch(batch_of(3))
    assert dict(batch.queries_per_cluster) == {"a": 3}
    with pytest.raises(grpc.RpcError) as e:
        admin.DrainCluster(pb.DrainClusterRequest(name="zzz"), metadata=md)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_add_and_remove_a_cluster(gateway):
    client, admin, queue, _ = gateway
    md = [("authorization", f"Bearer {TOKEN}")]
    added = admin.AddCluster(pb.AddClusterRequest(name="c", capacity_tokens_per_s=50), metadata=md)
    assert added.name == "c" and added.state == "active"
    batch = client.SubmitBatch(batch_of(6))
    assert dict(batch.queries_per_cluster) == {"a": 2, "b": 2, "c": 2}
    removed = admin.RemoveCluster(pb.RemoveClusterRequest(name="c"), metadata=md)
    assert sum(m.moved for m in removed.moves) == 2
    c = queue.clusters(["c"])[0]
    assert (c.state, c.queue_length) == ("removed", 0)
    assert sum(x.queue_length for x in queue.clusters(["a", "b"])) == 6
    names = [x.name for x in client.ListClusters(pb.ListClustersRequest()).clusters]
    assert names == ["a", "b"]  # a removed cluster leaves the listing


def test_health_and_reflection(gateway):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    *_, address = gateway
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        resp = health.Check(health_pb2.HealthCheckRequest(service="fleetbatch.v1.BatchService"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        (answer,) = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for s in answer.list_services_response.service}
        assert {"fleetbatch.v1.BatchService", "fleetbatch.v1.AdminService"} <= names


def test_a_restarted_gateway_loses_nothing(redis_url):
    config = GatewayConfig(
        redis_url=redis_url, policy="round_robin", offload=False, clusters=[ClusterSpec("a")]
    )
    first = GatewayThread(config)
    with grpc.insecure_channel(first.start()) as ch:
        batch = pb_grpc.BatchServiceStub(ch).SubmitBatch(batch_of(4, batch_id="survivor"))
    first.stop()
    queue = WorkQueue(connect(redis_url))
    (claimed, *_) = queue.claim("a", 1, "w", 30)
    queue.complete(
        claimed.query.gid, {"query_id": claimed.query.query_id, "text": "done before restart"}, "completed", 3
    )
    second = GatewayThread(GatewayConfig(redis_url=redis_url, policy="round_robin", offload=False))
    try:
        with grpc.insecure_channel(second.start()) as ch:
            stub = pb_grpc.BatchServiceStub(ch)
            info = stub.GetBatch(pb.GetBatchRequest(batch_id=batch.id))
            assert (
                info.status == pb.IN_PROGRESS
                and info.request_counts.total == 4
                and info.request_counts.completed == 1
            )
            (result,) = list(stub.StreamResults(pb.StreamResultsRequest(batch_id=batch.id)))
            assert result.text == "done before restart"
            assert queue.clusters(["a"])[0].queue_length == 3
    finally:
        second.stop()


def test_gateway_serve_cli_starts_and_stops_cleanly(redis_url, capsys):
    import os
    import signal
    import subprocess
    import sys

    from gateway.cli import main
    from gateway.grpc_api.tls import channel
    from tests.harness import REPO, serving_address

    token = "ci-token-0123456789abcdef"  # the client tokens and the Redis URL come by environment
    env = dict(os.environ, FLEETBATCH_CLIENT_TOKENS=f"ci:{token}", FLEETBATCH_REDIS_URL=redis_url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--listen", "127.0.0.1:0"],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        address = serving_address(proc)
        with channel(address, token=token) as ch:
            assert pb_grpc.BatchServiceStub(ch).ListClusters(pb.ListClustersRequest(), timeout=10) is not None
        with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as e:
            pb_grpc.BatchServiceStub(ch).ListClusters(pb.ListClustersRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert main(["status", "--target", address, "--token", token, "--json"]) == 0
        assert main(["status", "--target", address, "--token", "wrong-token-0123456789"]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
