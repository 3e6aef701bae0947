"""Redis down or restarting: the gateway answers UNAVAILABLE (retryable), not UNKNOWN, and serves
again once Redis is back, without a restart."""

from __future__ import annotations

import grpc
import pytest

from gateway.config import ClusterSpec, GatewayConfig
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread
from workqueue.embedded import EmbeddedRedis


def _batch(n: int) -> pb.SubmitBatchRequest:
    req = pb.SubmitBatchRequest()
    for i in range(n):
        req.queries.add(id=f"q{i}", prompt=f"Explain topic number {i}.", max_tokens=8)
    return req


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_redis_down_is_unavailable_and_recovers(tmp_path):
    run_dir = tmp_path / "redis"
    server = EmbeddedRedis(run_dir, persist=True)
    config = GatewayConfig(
        redis_url=server.url,
        policy="round_robin",
        offload=False,
        clusters=[ClusterSpec("a", capacity_tps=100), ClusterSpec("b", capacity_tps=100)],
    )
    g = GatewayThread(config)
    channel = grpc.insecure_channel(g.start())
    stub = pb_grpc.BatchServiceStub(channel)
    try:
        first = stub.SubmitBatch(_batch(3))
        server.close()
        for call in (
            lambda: stub.GetBatch(pb.GetBatchRequest(batch_id=first.id)),
            lambda: stub.SubmitBatch(_batch(2)),
            lambda: stub.ListClusters(pb.ListClustersRequest()),
            lambda: list(stub.StreamResults(pb.StreamResultsRequest(batch_id=first.id))),
        ):
            code, details = _code(call)
            assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
            assert "Redis" in details
        server = EmbeddedRedis(run_dir, persist=True)  # back, with its data
        again = stub.GetBatch(pb.GetBatchRequest(batch_id=first.id))
        assert again.id == first.id and again.request_counts.total == 3
        assert stub.SubmitBatch(_batch(2)).request_counts.total == 2
    finally:
        channel.close()
        g.stop()
        server.close()
