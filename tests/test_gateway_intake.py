"""Background intake of large batches: accepted durably at once (VALIDATING), enqueued in chunks afterwards.

A 5,000-query batch (chunks of 500, the real heuristic predictor) is answered VALIDATING before
any query is queued and ends with every query queued exactly once; a gateway stopped mid-intake
(or one that died holding the intake lease) is finished by another gateway on the same Redis;
a batch cancelled during intake gets none of its remaining rows queued and ends CANCELLED; the
queue invariants (extended by the rows not yet enqueued) hold throughout.
"""

from __future__ import annotations

import json
import time

import grpc
import pytest

from gateway.checks.validation import Checked
from gateway.config import ClusterSpec, GatewayConfig
from gateway.intake.background import Intake, IntakeSettings, encode_rows
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, wait_until
from workqueue import WorkQueue, connect, keys
from workqueue.batches import INTAKE
from workqueue.invariants import check

N = 5000
CLUSTERS = ("a", "b")


def gateway(redis_url: str) -> GatewayThread:
    clusters = [ClusterSpec(c, capacity_tps=100 * (i + 1)) for i, c in enumerate(CLUSTERS)]
    return GatewayThread(GatewayConfig(redis_url=redis_url, offload=False, clusters=clusters))


def submission(n: int = N, batch_id: str = "big") -> pb.SubmitBatchRequest:
    req = pb.SubmitBatchRequest(batch_id=batch_id)
    for i in range(n):
        req.queries.add(id=f"q{i}", prompt=f"Explain item {i} " + "word " * (i % 7), max_tokens=16)
    return req


def queued(queue: WorkQueue) -> list[str]:
    return [g for c in CLUSTERS for g in queue.queued_ids(c)]


def enqueued(queue: WorkQueue, batch_id: str = "big") -> int:
    return int(queue.r.hget(keys.batch(batch_id), "intake_done") or 0)


def finish_on_a_new_gateway(redis_url: str, queue: WorkQueue, what: str) -> None:
    """Start another gateway on the same Redis and wait until it has enqueued the whole batch."""
    g = gateway(redis_url)
    g.start()
    try:
        wait_until(lambda: enqueued(queue) == N, 60, what, 0.05)
    finally:
        g.stop()


@pytest.fixture
def slow_chunks(monkeypatch):
    """Chunks of 500 rows with a pause between them, so a test can act mid-intake."""
    monkeypatch.setenv("FLEETBATCH_INTAKE_CHUNK", "500")
    monkeypatch.setenv("FLEETBATCH_INTAKE_PAUSE_S", "0.3")
    monkeypatch.setenv("FLEETBATCH_INTAKE_POLL_S", "0.05")


def test_a_large_batch_is_answered_validating_and_every_query_is_queued_once(redis_url, monkeypatch):
    monkeypatch.setenv("FLEETBATCH_INTAKE_CHUNK", "500")
    g = gateway(redis_url)
    with grpc.insecure_channel(g.start()) as ch:
        stub = pb_grpc.BatchServiceStub(ch)
        queue = WorkQueue(connect(redis_url))
        t0 = time.perf_counter()
        batch = stub.SubmitBatch(submission())
        assert batch.status == pb.VALIDATING and batch.request_counts.total == N
        assert time.perf_counter() - t0 < 30
        wait_until(lambda: enqueued(queue) == N, 60, "every chunk enqueued", 0.05)
        ids = queued(queue)
        assert len(ids) == len(set(ids)) == N
        assert set(ids) == {f"big:q{i}" for i in range(N)}
        info = stub.GetBatch(pb.GetBatchRequest(batch_id="big"))
        assert info.status == pb.IN_PROGRESS and sum(info.queries_per_cluster.values()) == N
        assert queue.r.zscore(INTAKE, "big") is None and not check(queue.r)
        payload = json.loads(queue.r.hget(keys.query("big:q3"), "payload"))
        assert payload["prompt"].startswith("Explain item 3") and payload["prompt_tokens"] > 0
        assert 0 < payload["predicted_tokens"] <= 16
        again = stub.SubmitBatch(submission())  # a retry gets the batch; other queries under its id do not
        assert again.id == "big" and again.request_counts.total == N
        other = submission()
        other.queries[7].prompt = "something else"
        with pytest.raises(grpc.RpcError) as e:
            stub.SubmitBatch(other)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    g.stop()


def test_a_gateway_stopped_mid_intake_is_finished_by_another(redis_url, slow_chunks):
    queue = WorkQueue(connect(redis_url))
    first = gateway(redis_url)
    with grpc.insecure_channel(first.start()) as ch:
        batch = pb_grpc.BatchServiceStub(ch).SubmitBatch(submission())
    assert batch.status == pb.VALIDATING
    wait_until(lambda: enqueued(queue) >= 1000, 60, "two chunks enqueued", 0.02)
    first.stop()
    stopped_at = enqueued(queue)
    assert 0 < stopped_at < N and not check(queue.r)
    assert queue.batch("big").status == "in_progress"
    time.sleep(0.5)
    assert enqueued(queue) == stopped_at  # nobody enqueues while no gateway runs
    finish_on_a_new_gateway(redis_url, queue, "the second gateway to finish the intake")
    ids = queued(queue)
    assert len(ids) == len(set(ids)) == N and not check(queue.r)


def test_a_dead_holder_of_the_intake_lease_delays_the_batch_only_until_it_lapses(redis_url, monkeypatch):
    """A gateway that died holding a batch's lease (never released): another takes over once it lapses."""
    monkeypatch.setenv("FLEETBATCH_INTAKE_CHUNK", "500")
    monkeypatch.setenv("FLEETBATCH_INTAKE_POLL_S", "0.05")
    queue = WorkQueue(connect(redis_url))
    g = gateway(redis_url)
    with grpc.insecure_channel(g.start()) as ch:
        stub = pb_grpc.BatchServiceStub(ch)
        stub.SubmitBatch(submission(2000, "warm"))  # the gateway's own intake runs
        wait_until(lambda: enqueued(queue, "warm") == 2000, 60, "the first batch", 0.05)
        g.stop()
    ttl = 2.0  # the dead holder's lease (each chunk it lands extends the lease by its own settings' ttl)
    dead = Intake(
        queue,
        lambda ps: [8.0] * len(ps),
        lambda loads, views: ["a"] * len(loads),
        IntakeSettings(chunk=500, lease_ttl_s=ttl),
    )
    req = submission()
    checked = Checked(prompt_tokens=[5] * N, max_tokens=[16] * N)
    assert queue.accept_batch("big", encode_rows(req, checked), fingerprint="x")
    assert queue.batch("big").status == "validating" and not check(queue.r)
    assert queue.take_intake("big", "dead-token", ttl_s=ttl)
    t0 = time.monotonic()  # before the last extension: the lease lapses no sooner than ttl from here
    assert dead.step("big", "dead-token") == 500  # one chunk, then the holder dies (no release)
    assert dead.step("big", "stale-token") == -1  # a lease it does not hold lands nothing
    finish_on_a_new_gateway(redis_url, queue, "the lease to lapse and the intake to finish")
    assert time.monotonic() - t0 >= ttl - 0.05  # not before the dead holder's lease lapsed (Redis's clock)
    ids = [g for g in queued(queue) if g.startswith("big:")]
    assert len(ids) == len(set(ids)) == N and not check(queue.r)


def test_cancel_during_intake_enqueues_no_more_and_ends_cancelled(redis_url, slow_chunks):
    queue = WorkQueue(connect(redis_url))
    g = gateway(redis_url)
    with grpc.insecure_channel(g.start()) as ch:
        stub = pb_grpc.BatchServiceStub(ch)
        stub.SubmitBatch(submission())
        wait_until(lambda: enqueued(queue) >= 500, 60, "a first chunk", 0.02)
        claimed = queue.claim("a", 2, "w", 30.0) + queue.claim("b", 2, "w", 30.0)  # running at the cancel
        first = claimed[0].query
        queue.complete(first.gid, {"batch_id": "big", "query_id": first.query_id}, "completed", 1)
        got = stub.CancelBatch(pb.CancelBatchRequest(batch_id="big"))
        assert got.status == pb.CANCELLING
        assert not check(queue.r)
        wait_until(lambda: queue.r.zscore(INTAKE, "big") is None, 60, "the intake to wind up", 0.05)
        assert queued(queue) == [] and not check(queue.r)
        for c in claimed[1:]:  # the running ones finish (their workers would abort them)
            queue.complete(c.query.gid, {"batch_id": "big", "query_id": c.query.query_id}, "cancelled", 0)
        info = stub.GetBatch(pb.GetBatchRequest(batch_id="big"))
        assert info.status == pb.CANCELLED
        counts = info.request_counts
        assert counts.completed == 1 and counts.cancelled == N - 1 and counts.total == N
        assert sum(info.queries_per_cluster.values()) < N  # the rows after the cancel were never queued
        results = list(stub.StreamResults(pb.StreamResultsRequest(batch_id="big")))
        assert len({r.query_id for r in results}) == N
        assert not check(queue.r)
    g.stop()


def test_small_batches_keep_the_synchronous_path(redis_url):
    g = gateway(redis_url)
    with grpc.insecure_channel(g.start()) as ch:
        batch = pb_grpc.BatchServiceStub(ch).SubmitBatch(submission(50, "small"))
    g.stop()
    assert batch.status == pb.IN_PROGRESS and sum(batch.queries_per_cluster.values()) == 50
