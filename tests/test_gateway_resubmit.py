"""batch_id makes retries safe: the same submission again gets the existing batch; other queries
under an existing id (even with the same count) are ALREADY_EXISTS, as the proto promises."""

from __future__ import annotations

import grpc
import pytest

from gateway.config import ClusterSpec, GatewayConfig
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread


@pytest.fixture
def client(redis_url):
    g = GatewayThread(
        GatewayConfig(redis_url=redis_url, offload=False, clusters=[ClusterSpec("a", capacity_tps=100)])
    )
    channel = grpc.insecure_channel(g.start())
    yield pb_grpc.BatchServiceStub(channel)
    channel.close()
    g.stop()


def submission(prompts: list[str]) -> pb.SubmitBatchRequest:
    req = pb.SubmitBatchRequest(batch_id="same-id")
    for i, p in enumerate(prompts):
        req.queries.add(id=f"q{i}", prompt=p, max_tokens=8)
    return req


def test_a_retry_gets_the_batch_and_other_queries_under_its_id_are_refused(client):
    first = client.SubmitBatch(submission(["one", "two", "three"]))
    again = client.SubmitBatch(submission(["one", "two", "three"]))
    assert again.id == first.id == "same-id" and again.request_counts.total == 3
    with pytest.raises(grpc.RpcError) as e:
        client.SubmitBatch(submission(["one", "two", "something else"]))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "other queries" in e.value.details()
    changed = submission(["one", "two", "three"])
    changed.queries[0].max_tokens = 9
    with pytest.raises(grpc.RpcError) as e:
        client.SubmitBatch(changed)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
