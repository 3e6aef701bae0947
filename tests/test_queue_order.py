"""Issue 33: the token policies enqueue a batch longest predicted first (an even finish: the long
queries start early and a queue's tail is short, cheap for the offloader to move); round robin keeps
the batch's order. Both intake paths, a real gateway on loopback and a real Redis."""

from __future__ import annotations

import json

import grpc
import pytest

from gateway.assign.policies import QueryLoad, RoundRobin, TokenPolicy, queue_order
from gateway.config import ClusterSpec, GatewayConfig
from gateway.intake.chunks import Chunk, landing
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, wait_until
from workqueue import WorkQueue, connect, keys


def test_queue_order_is_longest_predicted_first_for_token_policies_only():
    loads = [
        QueryLoad("a", 5, 10.0),
        QueryLoad("b", 9, 30.0),
        QueryLoad("c", 7, 10.0),
        QueryLoad("d", 1, 30.0),
    ]
    assert queue_order(TokenPolicy(), loads) == [1, 3, 2, 0]  # ties: the longer prompt first
    assert queue_order(RoundRobin(), loads) == [0, 1, 2, 3]


def submission(n: int) -> pb.SubmitBatchRequest:
    req = pb.SubmitBatchRequest(batch_id=f"b{n}")
    for i in range(n):  # the gateway's heuristic predicts 64 + prompt words: lengths cycle 1..7 words
        req.queries.add(id=f"q{i}", prompt="word " * (1 + i * 3 % 7), max_tokens=512)
    return req


@pytest.mark.parametrize("policy", ["token", "round_robin"])
def test_a_batch_enters_its_queue_in_the_policys_order(redis_url, monkeypatch, policy):
    monkeypatch.setenv(
        "FLEETBATCH_INTAKE_SYNC_MAX", "20"
    )  # the 40-row batch goes through the background intake
    monkeypatch.setenv("FLEETBATCH_INTAKE_FIRST_CHUNK", "8")
    config = GatewayConfig(
        redis_url=redis_url, policy=policy, offload=False, clusters=[ClusterSpec("a", capacity_tps=100)]
    )
    g = GatewayThread(config)
    channel = grpc.insecure_channel(g.start())
    queue = WorkQueue(connect(redis_url))
    try:
        stub = pb_grpc.BatchServiceStub(channel)
        for n in (10, 40):  # created in SubmitBatch; enqueued by the intake in chunks of 8, 16, 32
            stub.SubmitBatch(submission(n))
            wait_until(
                lambda n=n: sum(g.startswith(f"b{n}:") for g in queue.queued_ids("a")) == n, 60, "rows queued"
            )
    finally:
        channel.close()
        g.stop()
    for n in (10, 40):
        ids = [g for g in queue.queued_ids("a") if g.startswith(f"b{n}:")]
        predicted = [json.loads(queue.r.hget(keys.query(g), "payload"))["predicted_tokens"] for g in ids]
        assert len(set(predicted)) > 1
        if policy == "round_robin":
            assert ids == [f"b{n}:q{i}" for i in range(n)]
        elif n == 10:
            assert predicted == sorted(predicted, reverse=True)
        else:  # each chunk of the intake is longest first
            chunks = [predicted[:8], predicted[8:24], predicted[24:]]
            assert all(c == sorted(c, reverse=True) for c in chunks) and predicted != sorted(
                predicted, reverse=True
            )


def test_an_intake_chunk_is_ordered_within_each_script_calls_slice():
    """Review of issue 33: a chunk lands in parts of ``land`` rows, each part trimming as many rows off
    the intake list as it lands, so each part must hold exactly its slice of the rows; the order
    within a slice is the policy's (failed rows first)."""
    rows = [
        {"id": f"q{i}", "prompt": "p", "max_tokens": 64, "prompt_tokens": 3, "temperature": 0.0, "top_p": 1.0}
        for i in range(7)
    ]
    rows[4]["bad"] = "empty prompt"
    loads = [QueryLoad(r["id"], 3, float(10 * (i % 3))) for i, r in enumerate(rows) if "bad" not in r]
    chunk = Chunk(0, rows, loads)
    placed = {ld.key: ("a", "") for ld in loads}
    landed = landing("b", chunk, placed, queue_order(TokenPolicy(), loads), part=3)
    ids = [g.split(":")[1] for g, *_ in landed]
    assert ids[:3] == ["q2", "q1", "q0"] and ids[3:6] == ["q4", "q5", "q3"] and ids[6:] == ["q6"]
    assert [g for g, *_ in landing("b", chunk, placed)] == [
        f"b:q{i}" for i in range(7)
    ]  # no order: the rows'
