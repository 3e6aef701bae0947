"""The books of `fleetbatch loadgen chaos` on hand-made OpenAI batches (issue 31, build 2): a user's view
counts a missing or doubled ``custom_id``, ``request_counts`` that disagree with the files,
``usage`` that is not the lines' sum, and an error line for a row that could have run. And on
hand-made gRPC batches in a real Redis: a batch counting too many cannot hide a stuck one, the
counts are compared with the rows' outcomes, and a deliberate misfit is excused only when it
failed with its own error."""

from __future__ import annotations

import json
import threading

import pytest
from openai.types import Batch

from load.chaos.books import GrpcBatch, grpc_books
from load.chaos.client import ResilientClient
from load.chaos.openai_view import OpenAIRun, user_view
from load.chaos.run import FAULTS, ChaosConfig
from load.chaos.waves import kv_row, legit_failure, waves
from load.soaks.openai_check import input_rows
from load.workload import generated
from protos import fleetbatch_pb2 as pb
from workqueue import WorkQueue, connect, keys


def out_line(cid: str, prompt: int = 3, completion: int = 5) -> dict:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    body = {"object": "chat.completion", "id": "x", "created": 1, "model": "m", "usage": usage, "choices": []}
    return {
        "id": f"batch_req_{cid}",
        "custom_id": cid,
        "response": {"status_code": 200, "body": body},
        "error": None,
    }


KV_ERROR = "the KV cache (384 tokens) cannot hold this query: it needs 385 or more"


def err_line(cid: str, message: str = KV_ERROR) -> dict:
    return {
        "id": f"batch_req_{cid}",
        "custom_id": cid,
        "response": None,
        "error": {"code": "server_error", "message": message},
    }


def batch(completed: int, failed: int, total: int, usage: tuple[int, int]) -> Batch:
    return Batch.model_validate(
        {
            "id": "batch_1", "object": "batch", "endpoint": "/v1/chat/completions", "input_file_id": "f",
            "completion_window": "24h", "status": "completed", "created_at": 1, "in_progress_at": 2,
            "completed_at": 3, "request_counts": {"completed": completed, "failed": failed, "total": total},
            "usage": {"input_tokens": usage[0], "output_tokens": usage[1], "total_tokens": sum(usage),
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}},
        }
    )  # fmt: skip


def run_of(items, output, errors, b) -> OpenAIRun:
    return OpenAIRun("t", input_rows(items, "/v1/chat/completions"), "batch_1", b, output, errors)


def test_a_clean_batch_has_nothing_to_report():
    items = [*generated(3, max_tokens=8), kv_row("kv-0")]
    ids = [it.id for it in items]
    r = run_of(items, [out_line(i) for i in ids[:3]], [err_line("kv-0")], batch(3, 1, 4, (9, 15)))
    view = user_view([r])
    assert {k: v for k, v in view.items() if k != "openai_problems"} == {
        "output_lines_missing": 0, "output_lines_duplicated": 0, "wrongly_failed_lines": 0, "openai_violations": 0,
    }, view  # fmt: skip


def test_a_row_in_neither_file_a_doubled_row_and_counts_that_disagree_are_reported():
    items = [*generated(3, max_tokens=8), kv_row("kv-0")]
    ids = [it.id for it in items]
    # the KV row counted completed and in no file (finding 3)
    r = run_of(items, [out_line(i) for i in ids[:3]], [], batch(4, 0, 4, (9, 15)))
    view = user_view([r])
    assert view["output_lines_missing"] == 1 and view["output_lines_duplicated"] == 0, view
    assert view["openai_violations"] == 1 and "request_counts" in view["openai_problems"][0], view
    # one row twice, and usage that counts it once
    twice = [out_line(ids[0]), out_line(ids[1]), out_line(ids[1]), out_line(ids[2])]
    view = user_view([run_of(items[:3], twice, [], batch(3, 0, 3, (9, 15)))])
    assert view["output_lines_duplicated"] == 1 and view["openai_violations"] == 2, view


def test_an_error_line_for_a_row_that_could_run_is_wrongly_failed():
    items = generated(2, max_tokens=8)
    ids = [it.id for it in items]
    view = user_view([run_of(items, [out_line(ids[0])], [err_line(ids[1])], batch(1, 1, 2, (3, 5)))])
    assert view["wrongly_failed_lines"] == 1 and view["openai_violations"] == 0, view
    # a KV row is excused only for the KV cache's error, a sole- row only for its removal
    kv = [kv_row("kv-0")]
    view = user_view([run_of(kv, [], [err_line("kv-0", "connection reset")], batch(0, 1, 1, (0, 0)))])
    assert view["wrongly_failed_lines"] == 1, view
    assert legit_failure("kv-grpc-0", KV_ERROR) and not legit_failure("kv-grpc-0", "worker died")
    assert legit_failure("sole-0", "cluster medium-1 was removed") and not legit_failure("sole-0", KV_ERROR)
    assert not legit_failure(ids[1], KV_ERROR)


def write_batch(r, batch_id: str, counts: tuple[int, int, int], rows: list[dict]) -> None:
    """A batch's hash and results list as the queue's scripts leave them (written raw, so that
    the books can be shown counts that disagree)."""
    completed, failed, cancelled = counts
    r.hset(
        keys.batch(batch_id),
        mapping={
            "status": "completed",
            "total": 2,
            "completed": completed,
            "failed": failed,
            "cancelled": cancelled,
        },
    )
    for row in rows:
        r.rpush(keys.results(batch_id), json.dumps({"batch_id": batch_id, **row}))


def grpc_batch(batch_id: str, ids: list[str]) -> GrpcBatch:
    client = ResilientClient(
        ["127.0.0.1:1"], pb.SubmitBatchRequest(batch_id=batch_id), threading.Event(), "t"
    )
    return GrpcBatch(batch_id, batch_id, ids, client)  # never started: the books read Redis


def test_a_batch_counting_too_many_cannot_hide_a_stuck_one_and_counts_must_match_the_rows(redis_url):
    q = WorkQueue(connect(redis_url))
    ok = {"finish_reason": "stop"}
    write_batch(q.r, "over", (3, 0, 0), [{"query_id": "a", **ok}, {"query_id": "b", **ok}])
    write_batch(q.r, "short", (1, 0, 0), [{"query_id": "c", **ok}])
    books = grpc_books(q, [grpc_batch("over", ["a", "b"]), grpc_batch("short", ["c", "d"])])
    assert (books["stuck"], books["overcounted"], books["lost"]) == (1, 1, 1), books
    assert books["count_mismatches"] == 1 and "over" in books["count_problems"][0], books
    # a row with an error is failed whatever its finish_reason (workqueue.outcome), and must be
    # counted failed; a KV row failed with another error is wrongly failed
    rows = [
        {"query_id": "e", "finish_reason": "length", "error": "boom"},
        {"query_id": "kv-1", "finish_reason": "error", "error": "its worker died"},
    ]
    write_batch(q.r, "errs", (1, 1, 0), rows)
    books = grpc_books(q, [grpc_batch("errs", ["e", "kv-1"])])
    assert books["count_mismatches"] == 1 and "(0, 2, 0)" in books["count_problems"][0], books
    assert books["wrongly_failed_rows"] == 2, books
    write_batch(q.r, "kv", (0, 1, 0), [{"query_id": "kv-2", "finish_reason": "error", "error": KV_ERROR}])
    books = grpc_books(q, [grpc_batch("kv", ["kv-2"])])
    assert books["wrongly_failed_rows"] == books["count_mismatches"] == books["stuck"] == 0, books


def test_the_load_comes_in_one_wave_per_fault_plus_one_and_the_outage_outlasts_two_leases(tmp_path):
    w = waves(100, len(FAULTS) + 1, seed=0, max_tokens=8)
    assert len(w) == 16 and sum(map(len, w)) == 100 and min(map(len, w)) == 6
    assert len({it.id for wave in w for it in wave}) == 100
    c = ChaosConfig(run_dir=tmp_path, lease_s=3.0)
    assert c.outage_s == c.stop_s == 8.0
    with pytest.raises(ValueError, match="twice the lease"):
        ChaosConfig(run_dir=tmp_path, lease_s=3.0, outage_s=5.0)
    with pytest.raises(ValueError, match="one wave per fault"):
        ChaosConfig(run_dir=tmp_path, queries=5)
