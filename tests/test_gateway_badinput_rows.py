"""Per-row errors (``on_bad_query``) and the per-client cap on queued queries, on a real gateway and Redis."""

from __future__ import annotations

import grpc
import pytest

from gateway.config import ClusterSpec
from protos import fleetbatch_pb2 as pb
from tests import test_gateway_badinput as base
from tests.test_gateway_badinput import batch_of, rpc_error
from workqueue import keys

start = base.start  # the fixture: a gateway with config overrides


def test_fail_row_fails_bad_queries_alone(start):
    client, _, queue, _, _ = start()
    req = batch_of(5, batch_id="rows", on_bad_query=pb.ON_BAD_QUERY_FAIL_ROW)
    req.queries[1].prompt = "   "
    req.queries[3].sampling.temperature = float("nan")
    req.queries[4].prompt = "word " * 500  # over 64 tokens
    batch = client.SubmitBatch(req)
    assert (batch.request_counts.total, batch.request_counts.failed) == (5, 3)
    assert batch.status == pb.IN_PROGRESS
    assert sum(c.queue_length for c in queue.clusters()) == 2  # only the good rows wait for an engine
    failed = {r.query_id: r for r in client.StreamResults(pb.StreamResultsRequest(batch_id="rows"))}
    assert set(failed) == {"q1", "q3", "q4"}
    assert all(r.finish_reason == "error" for r in failed.values())
    assert "empty prompt" in failed["q1"].error and "temperature" in failed["q3"].error
    assert "limit is 64" in failed["q4"].error
    # the good rows run as usual
    for claimed in queue.claim("a", 5, "w", 30) + queue.claim("b", 5, "w", 30):
        q = claimed.query
        queue.complete(q.gid, {"batch_id": q.batch_id, "query_id": q.query_id, "text": "ok"}, "completed", 1)
    final = client.GetBatch(pb.GetBatchRequest(batch_id="rows"))
    assert final.status == pb.COMPLETED
    assert (final.request_counts.completed, final.request_counts.failed) == (2, 3)


def test_fail_row_still_rejects_what_cannot_be_a_row(start):
    client, _, queue, _, _ = start()
    req = batch_of(3, on_bad_query=pb.ON_BAD_QUERY_FAIL_ROW)
    req.queries[2].id = "q0"
    assert "duplicate id" in rpc_error(client.SubmitBatch, req).details()
    req = batch_of(2, on_bad_query=pb.ON_BAD_QUERY_FAIL_ROW)
    for q in req.queries:
        q.max_tokens = -1
    assert "every query of the batch is bad" in rpc_error(client.SubmitBatch, req).details()
    assert queue.r.keys(keys.query("*")) == []


def test_reject_is_the_default_and_the_gateway_default_can_be_fail_row(start):
    client, *_ = start(on_bad_query="fail-row")
    req = batch_of(2)
    req.queries[0].prompt = ""
    assert client.SubmitBatch(req).request_counts.failed == 1
    req.on_bad_query = pb.ON_BAD_QUERY_REJECT  # the request's choice wins
    assert rpc_error(client.SubmitBatch, req).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_per_client_cap_on_queued_queries(start):
    client, _, queue, _, _ = start(max_queued_per_client=5, clusters=[ClusterSpec("a")])
    alice = [("x-client-id", "alice")]
    client.SubmitBatch(batch_of(3, batch_id="a1"), metadata=alice)
    err = rpc_error(client.SubmitBatch, batch_of(3, batch_id="a2"), metadata=alice)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "alice" in err.details() and "max_queued_per_client=5" in err.details()
    # a resubmission of an accepted batch is idempotent, not refused
    assert client.SubmitBatch(batch_of(3, batch_id="a1"), metadata=alice).id == "a1"
    # another client has its own allowance; the header must be a key-safe name
    client.SubmitBatch(batch_of(3), metadata=[("x-client-id", "bob")])
    bad = rpc_error(client.SubmitBatch, batch_of(1), metadata=[("x-client-id", "a:b")])
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-client-id" in bad.details()
    # finished queries free the allowance
    for claimed in queue.claim("a", 2, "w", 30):
        q = claimed.query
        queue.complete(q.gid, {"batch_id": q.batch_id, "query_id": q.query_id}, "completed", 1)
    client.SubmitBatch(batch_of(3, batch_id="a2"), metadata=alice)
    # without a header, a client is its address
    client.SubmitBatch(batch_of(5))
    assert rpc_error(client.SubmitBatch, batch_of(1)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("cap", [0])
def test_no_cap_by_default(start, cap):
    client, *_ = start(max_queued_per_client=cap)
    for i in range(3):
        client.SubmitBatch(batch_of(40, batch_id=f"n{i}"))
