"""Retention (R9): a finished batch's keys expire after the configured TTL; nothing else is kept."""

from __future__ import annotations

import grpc

from gateway.config import ClusterSpec, GatewayConfig
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, wait_until
from workqueue import QueuedQuery, WorkQueue, connect, keys
from workqueue.invariants import check


def one_batch(q: WorkQueue, bid: str, n: int = 3) -> None:
    q.create_batch(bid, [(QueuedQuery(bid, f"q{i}", "p", 8, 4, 6.0), "a") for i in range(n)])


def finish_all(q: WorkQueue, n: int) -> list:
    claimed = q.claim("a", n, "w", 30)
    for c in claimed:
        q.complete(c.query.gid, {"batch_id": c.query.batch_id, "query_id": c.query.query_id}, "completed", 5)
    return claimed


def test_a_finished_batch_gets_the_ttl_and_a_running_one_does_not(redis_url):
    q = WorkQueue(connect(redis_url), retention_s=3600)
    q.register_cluster("a")
    one_batch(q, "done")
    one_batch(q, "running")
    finish_all(q, 4)  # all of "done", one of "running"
    for key in (keys.batch("done"), keys.results("done"), keys.done("done")):
        assert 3000 < q.r.ttl(key) <= 3600
    for key in (keys.batch("running"), keys.results("running")):
        assert q.r.ttl(key) == -1  # no expiry while in progress
    assert q.cancel_batch("running") == 2
    assert 3000 < q.r.ttl(keys.batch("running")) <= 3600  # cancelled is final too
    forever = WorkQueue(connect(redis_url), retention_s=0)
    one_batch(forever, "kept", 1)
    finish_all(forever, 1)
    assert q.r.ttl(keys.batch("kept")) == -1


def test_an_expired_batch_is_gone_and_a_late_completion_records_nothing(redis_url):
    q = WorkQueue(connect(redis_url), retention_s=1)
    q.register_cluster("a")
    one_batch(q, "old", 2)
    late = finish_all(q, 1)[0]  # one finished now ...
    stale = q.claim("a", 1, "slow", 30)[0]  # ... one claimed by a worker that will be late
    q.complete(stale.query.gid, {"query_id": "q1"}, "completed", 5)
    wait_until(lambda: q.batch("old") is None, 20, "the finished batch to expire")
    assert q.r.exists(keys.results("old"), keys.done("old")) == 0
    assert q.complete(late.query.gid, {"query_id": "q0"}, "completed", 5) == -1  # a duplicate, after expiry
    assert q.r.exists(keys.results("old"), keys.done("old"), keys.batch("old")) == 0
    assert q.batch_ids() == [] and q.r.zcard(keys.BATCHES) == 0
    assert check(q.r) == []


def test_the_gateway_applies_its_retention_setting(redis_url):
    config = GatewayConfig(
        redis_url=redis_url, offload=False, retention_s=1, clusters=[ClusterSpec("a", capacity_tps=100)]
    )
    g = GatewayThread(config)
    channel = grpc.insecure_channel(g.start())
    client = pb_grpc.BatchServiceStub(channel)
    try:
        req = pb.SubmitBatchRequest(batch_id="short")
        req.queries.add(id="q0", prompt="Say something.", max_tokens=4)
        client.SubmitBatch(req)
        q = WorkQueue(connect(redis_url))
        finish_all(q, 1)
        assert client.GetBatch(pb.GetBatchRequest(batch_id="short")).status == pb.COMPLETED

        def gone() -> bool:
            try:
                client.GetBatch(pb.GetBatchRequest(batch_id="short"))
            except grpc.RpcError as e:
                return e.code() == grpc.StatusCode.NOT_FOUND
            return False

        wait_until(gone, 20, "the batch to expire")
    finally:
        channel.close()
        g.stop()
