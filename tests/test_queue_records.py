"""The typed queue records both sides share: states, results and observations, byte for byte as before."""

from __future__ import annotations

import json

from engines.interface import RequestOutput
from engines.result_record import finished_record
from gateway.batches.messages import fail_rows, result_proto
from gateway.intake.rows import failed_result
from predictor.observed import encode_observed, read_observed
from protos import fleetbatch_pb2 as pb
from workqueue import (
    BatchState,
    ClaimedQuery,
    Observation,
    QueryResult,
    QueryState,
    QueuedQuery,
    WorkQueue,
    connect,
    keys,
)
from workqueue.records import FINAL_BATCH_STATES, FINAL_QUERY_STATES, FINAL_STATES, Timings

# what engines/worker.py wrote before the records were typed (its dict, in its key order)
OLD_WORKER_RESULT = {
    "batch_id": "b1",
    "query_id": "q7",
    "text": "Paris is the capital.",
    "prompt_tokens": 12,
    "completion_tokens": 5,
    "cluster": "a",
    "timings": {
        "enqueued_at": 1700000000.25,
        "started_at": 1700000001.5,
        "first_token_at": 1700000001.75,
        "finished_at": 1700000002.125,
    },
    "finish_reason": "stop",
    "error": "",
    "predicted_tokens": 6.5,
    "attempts": 2,
}
OLD_OBSERVATION = {
    "prompt": "What is the capital of France?",
    "length": 5,
    "source": "chat",
    "cluster": "a",
    "predicted": 6.5,
}


def claimed(batch_id: str = "b1", query_id: str = "q7") -> ClaimedQuery:
    q = QueuedQuery(
        batch_id, query_id, "What is the capital of France?", 8, 12, 6.5, metadata={"source": "chat"}
    )
    return ClaimedQuery(q, attempts=2, enqueued_at=1700000000.25, claimed_at=1700000001.5)


def worker_result(cq: ClaimedQuery, out: RequestOutput, kind: QueryState) -> QueryResult:
    """The record the queue agent writes for a finished query (its state from the output's outcome)."""
    done = finished_record("a", cq, out)
    assert done.kind == kind
    return done.result


def test_states_keep_their_strings():
    assert [s.value for s in QueryState] == [
        "queued",
        "running",
        "cancelling",
        "completed",
        "failed",
        "cancelled",
    ]
    assert [s.value for s in BatchState] == [
        "validating",
        "in_progress",
        "completed",
        "failed",
        "cancelling",
        "cancelled",
        "expiring",
        "expired",
    ]
    old_final = ("completed", "failed", "cancelled")
    assert FINAL_QUERY_STATES == set(old_final) and FINAL_BATCH_STATES == {*old_final, "expired"}
    assert FINAL_STATES == FINAL_BATCH_STATES
    assert all(s in FINAL_STATES for s in old_final) and "in_progress" not in FINAL_STATES
    assert json.dumps({"status": BatchState.IN_PROGRESS}) == '{"status": "in_progress"}'
    assert f"{QueryState.CANCELLED}" == str(QueryState.CANCELLED) == "cancelled"


def test_worker_result_json_is_what_the_old_dict_wrote():
    out = RequestOutput(
        "b1:q7", "Paris is the capital.", [1, 2, 3, 4, 5], 12, "stop", 1700000001.75, 1700000002.125
    )
    r = worker_result(claimed(), out, QueryState.COMPLETED)
    old = json.dumps(OLD_WORKER_RESULT)
    assert r.to_json() == old
    assert QueryResult.from_json(old).to_json() == old
    assert QueryResult.from_json(old) == r
    assert r.timings == Timings(1700000000.25, 1700000001.5, 1700000001.75, 1700000002.125)


def test_cancelled_and_failed_results_keep_their_shape():
    aborted = worker_result(
        claimed(), RequestOutput("b1:q7", "", [], 12, "abort", finish_time=3.0), QueryState.CANCELLED
    )
    assert aborted.finish_reason == "cancelled" and aborted.to_dict()["timings"]["first_token_at"] == 0.0
    failed = RequestOutput("b1:q7", "", [], 0, "error", finish_time=3.0, error="too long")
    d = json.loads(worker_result(claimed(), failed, QueryState.FAILED).to_json())
    assert list(d) == list(OLD_WORKER_RESULT) and d["finish_reason"] == "error" and d["error"] == "too long"
    # the gateway's failures: four keys, in the old order
    old = json.dumps(
        {"batch_id": "b1", "query_id": "q0", "finish_reason": "error", "error": "invalid query: x"}
    )
    assert failed_result("b1", "q0", "invalid query: x") == old
    assert QueryResult.from_json(old).to_json() == old
    # the queue scripts' failures (cjson, no spaces) read back with the same keys and values
    for lua in (
        '{"batch_id":"b1","query_id":"q0","cluster":"a","finish_reason":"cancelled"}',
        '{"batch_id":"b1","query_id":"q0","cluster":"","finish_reason":"error","error":"failed 3 times","attempts":3}',
    ):
        assert QueryResult.from_json(lua).to_dict() == json.loads(lua)


def test_observation_json_is_what_the_old_dict_wrote():
    old = json.dumps(OLD_OBSERVATION)
    obs = Observation("What is the capital of France?", 5, "chat", "a", 6.5)
    assert obs.to_json() == old == encode_observed("What is the capital of France?", 5, "chat", "a", 6.5)
    assert Observation.from_json(old) == obs and Observation.from_json(old).to_json() == old
    assert Observation.from_json('{"prompt": "p", "length": 3}') == Observation("p", 3)


def test_a_worker_result_reaches_the_gateway_with_every_field(redis_url):
    queue = WorkQueue(connect(redis_url))
    q = claimed().query
    assert queue.create_batch("b1", [(q, "a"), (QueuedQuery("b1", "bad", "", 8, 0, 0.0), "a")])
    (cq, _) = queue.claim("a", 2, "w", 30)
    out = RequestOutput(
        q.gid, "Paris is the capital.", [1, 2, 3, 4, 5], 12, "stop", 1700000001.75, 1700000002.125
    )
    sent = worker_result(cq, out, QueryState.COMPLETED)
    assert queue.complete(q.gid, sent, QueryState.COMPLETED, out.completion_tokens) == 0
    queue.record_observed([Observation(q.prompt, 5, "chat", "a", q.predicted_tokens)])

    raw = queue.r.lrange(keys.results("b1"), 0, -1)
    assert raw == [sent.to_json()]
    (got,) = queue.query_results("b1")
    assert got.index == 0 and got == QueryResult(**{**vars(sent), "index": 0})
    assert queue.results("b1") == [{**sent.to_dict(), "index": 0}]
    p = result_proto(got)
    t = sent.timings
    assert p == pb.QueryResult(
        batch_id="b1",
        query_id="q7",
        text="Paris is the capital.",
        prompt_tokens=12,
        completion_tokens=5,
        cluster="a",
        timings=pb.Timings(
            enqueued_at=t.enqueued_at,
            started_at=t.started_at,
            first_token_at=1700000001.75,
            finished_at=1700000002.125,
        ),
        finish_reason="stop",
        error="",
        predicted_tokens=6.5,
        index=0,
        attempts=cq.attempts,
    )
    assert cq.attempts == 1 and t.enqueued_at > 0 and t.started_at > 0

    # the gateway's own failure for the other query, then the batch is final
    fail_rows(
        queue, "b1", pb.SubmitBatchRequest(queries=[pb.Query(id="q7"), pb.Query(id="bad")]), {1: "empty"}
    )
    second = queue.query_results("b1", 1)[0]
    assert second == QueryResult("b1", "bad", finish_reason="error", error="invalid query: empty", index=1)
    assert (
        result_proto(second).error == "invalid query: empty" and result_proto(second).timings == pb.Timings()
    )
    info = queue.batch("b1")
    assert info.status == BatchState.COMPLETED and info.final and (info.completed, info.failed) == (1, 1)

    (rec,) = read_observed(redis_url)
    assert (rec.prompt, rec.length, rec.source, rec.meta) == (
        q.prompt,
        5,
        "chat",
        {"cluster": "a", "predicted": 6.5},
    )
