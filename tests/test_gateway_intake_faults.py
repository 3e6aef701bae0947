"""Background intake through faults (issue 31, findings 5, 8 and 9), on a real Redis.

* A row that only a restarting cluster can take waits for it (bounded by ``wait_s``, measured
  on the queue's injected clock) and lands once its heartbeat is back; after the bound it
  fails with a clear error. A row over every configured cluster's limit fails at once,
  naming the limit; the synchronous path answers INVALID_ARGUMENT for it and UNAVAILABLE
  only while the cluster that fits is not alive, and a large batch is accepted meanwhile.
* Turns are fair: one round gives every batch in intake one turn, so a big batch accepted
  first does not keep a later one waiting until it is done; alone, a batch's turn runs on.
* A batch whose intake list is lost is failed once (rows never enqueued counted failed), leaves
  the intake set, and a client retrying its batch_id gets that final state.
"""

from __future__ import annotations

import logging

import grpc
import pytest

from gateway.assign.registry import make_policy
from gateway.config import ClusterSpec, GatewayConfig
from gateway.http_api.objects import batch_object
from gateway.intake.background import Intake, IntakeSettings
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import Clock, GatewayThread, accept, enqueued, restarting, wait_until
from workqueue import WorkQueue, connect, keys
from workqueue.batches import INTAKE, intake_key
from workqueue.invariants import check


@pytest.fixture
def fleet(redis_url):
    """A queue on a hand-moved clock; 'small' alive (limit 50 tokens), 'big' restarting (limit 1000)."""
    clock = Clock()
    queue = WorkQueue(connect(redis_url), clock=clock)
    queue.register_cluster("small", capacity_hint_tps=100, max_query_tokens=50)
    queue.register_cluster("big", capacity_hint_tps=100, max_query_tokens=1000)
    queue.heartbeat("small", 3600.0)
    restarting(queue, "big")
    intake = Intake(
        queue,
        lambda prompts: [8.0] * len(prompts),
        make_policy("least_loaded").assign,
        IntakeSettings(chunk=10, first_chunk=10, land=10),
        wait_s=60.0,
    )
    return queue, clock, intake


def test_rows_for_a_restarting_cluster_wait_and_land_when_its_heartbeat_is_back(fleet):
    queue, clock, intake = fleet
    accept(queue, "w", 4, prompt_tokens=200)  # over small's limit: only big can take them
    landed = intake.tick()
    assert queue.batch("w").failed == 0 and landed == 0
    clock.now += 59  # within the bound: still waiting, nothing failed
    landed = intake.tick()
    info = queue.batch("w")
    assert info.status == "validating" and info.failed == 0 and enqueued(queue, "w") == 0 and landed == 0
    assert not check(queue.r)
    queue.heartbeat("big", 3600.0)  # the engine is back
    assert intake.tick() == 4
    assert sorted(queue.queued_ids("big")) == [f"w:q{i}" for i in range(4)]
    assert queue.batch("w").failed == 0 and not check(queue.r)
    assert queue.r.hget(keys.batch("w"), "intake_waiting_since") is None


def test_rows_fail_with_a_clear_error_once_the_wait_is_over(fleet):
    queue, clock, intake = fleet
    accept(queue, "w", 3, prompt_tokens=200)
    landed = intake.tick()
    assert queue.batch("w").failed == 0 and landed == 0
    clock.now += 61
    assert intake.tick() == 3
    info = queue.batch("w")
    assert info.status == "failed" and info.failed == 3
    errors = {r["error"] for r in queue.results("w")}
    assert len(errors) == 1 and "within 60 s" in errors.pop()
    assert not check(queue.r)


def test_a_row_over_every_configured_limit_fails_at_once_naming_it(fleet):
    queue, _, intake = fleet
    accept(queue, "w", 2, prompt_tokens=2000)  # over big's limit too: permanent
    landed = intake.tick()
    info = queue.batch("w")
    assert info.status == "failed" and info.failed == 2
    for r in queue.results("w"):
        assert "largest per-query limit of any configured cluster is 1000" in r["error"]
    assert landed == 2
    assert not check(queue.r)


def test_turns_are_fair_a_big_batch_does_not_block_a_later_one(redis_url):
    clock = Clock()
    queue = WorkQueue(connect(redis_url), clock=clock)
    queue.register_cluster("a", capacity_hint_tps=100)
    order: list[str] = []

    def predict(prompts: list[str]) -> list[float]:
        order.append(prompts[0].split()[0])
        return [4.0] * len(prompts)

    intake = Intake(
        queue,
        predict,
        make_policy("round_robin").assign,
        IntakeSettings(chunk=10, first_chunk=10, land=10, turn=10),
    )
    accept(queue, "big", 100)
    clock.now += 1
    accept(queue, "late", 20)
    landed = intake.tick()  # one round: one turn each
    assert enqueued(queue, "big") == 10 and enqueued(queue, "late") == 10 and landed == 20
    assert intake.tick() == 20 and enqueued(queue, "late") == 20  # round 2: the late batch is done
    assert intake.tick() == 80  # alone now: its turn runs on to the end
    assert intake.tick() == 0 and enqueued(queue, "big") == 100
    assert order[:4] == ["big", "late", "big", "late"] and set(order[4:]) == {"big"}
    assert not check(queue.r)


def test_a_lost_intake_list_fails_its_rows_once_and_the_batch_finishes(redis_url, caplog):
    queue = WorkQueue(connect(redis_url))
    queue.register_cluster("a", capacity_hint_tps=100)
    intake = Intake(
        queue,
        lambda prompts: [4.0] * len(prompts),
        make_policy("round_robin").assign,
        IntakeSettings(chunk=10, first_chunk=10, land=10, turn=10),
    )
    accept(queue, "z", 30)
    assert queue.take_intake("z", "t", 30.0) and intake.step("z", "t") == 10  # one chunk enqueued
    queue.drop_intake("z", "t")
    queue.r.delete(intake_key("z"))  # lost: evicted, deleted, or gone in a failover
    caplog.set_level(logging.ERROR, logger="gateway.intake.background")
    for _ in range(3):
        intake.tick()
    lost = [r for r in caplog.records if "intake list lost" in r.getMessage()]
    assert len(lost) == 1
    assert queue.r.zscore(INTAKE, "z") is None and queue.intake_batches() == []
    info = queue.batch("z")
    assert info.status == "in_progress" and info.failed == 20 and info.total == 30
    assert "20 of 30 rows not yet enqueued" in info.error
    assert info.error in batch_object("z", info, {})["errors"]["data"][0]["message"]  # OpenAI's view
    assert not check(queue.r)
    for c in queue.claim("a", 10, "w", 30.0):  # the rows that were enqueued still run
        q = c.query
        queue.complete(q.gid, {"batch_id": "z", "query_id": q.query_id}, "completed", 1)
    info = queue.batch("z")
    assert info.final and info.completed == 10 and info.failed == 20
    assert not check(queue.r)


def test_the_grpc_answers_permanent_and_transient_misfits_apart(redis_url, monkeypatch):
    """Sync path: over every limit is INVALID_ARGUMENT; fits only a restarting cluster is UNAVAILABLE.
    A large batch is accepted while that cluster restarts, and lands once it is back. A batch
    whose intake list was lost is failed, and a client retrying its batch_id gets that state."""
    monkeypatch.setenv("FLEETBATCH_INTAKE_SYNC_MAX", "4")
    monkeypatch.setenv("FLEETBATCH_INTAKE_POLL_S", "0.05")
    queue = WorkQueue(connect(redis_url))
    accept(queue, "zombie", 5)
    queue.r.delete(intake_key("zombie"))
    clusters = [ClusterSpec("a", capacity_tps=100, max_query_tokens=64)]
    g = GatewayThread(GatewayConfig(redis_url=redis_url, offload=False, clusters=clusters))
    with grpc.insecure_channel(g.start()) as ch:
        stub = pb_grpc.BatchServiceStub(ch)
        wait_until(lambda: queue.batch("zombie").final, 60, "the lost intake to be failed", 0.05)
        retry = pb.SubmitBatchRequest(batch_id="zombie")
        for i in range(5):
            retry.queries.add(id=f"q{i}", prompt=f"zombie {i}", max_tokens=8)
        got = stub.SubmitBatch(retry)
        assert got.status == pb.FAILED and got.request_counts.failed == 5

        long = pb.SubmitBatchRequest(batch_id="long")
        long.queries.add(id="q0", prompt="word " * 200, max_tokens=8)
        with pytest.raises(grpc.RpcError) as e:
            stub.SubmitBatch(long)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "largest per-query limit of any configured cluster is 64" in e.value.details()

        restarting(queue, "a")
        short = pb.SubmitBatchRequest(batch_id="short")
        short.queries.add(id="q0", prompt="Hello.", max_tokens=8)
        with pytest.raises(grpc.RpcError) as e:
            stub.SubmitBatch(short)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE

        large = pb.SubmitBatchRequest(batch_id="large")
        for i in range(4):
            large.queries.add(id=f"q{i}", prompt=f"Hello {i}.", max_tokens=8)
        assert stub.SubmitBatch(large).status == pb.VALIDATING  # intake waits for 'a'
        queue.heartbeat("a", 3600.0)
        wait_until(lambda: enqueued(queue, "large") == 4, 60, "the large batch to land", 0.05)
        assert queue.batch("large").failed == 0 and len(queue.queued_ids("a")) == 4
    g.stop()
