"""The books of `loadgen chaos` on hand-made OpenAI batches (issue 31, build 2): a user's view
counts a missing or doubled ``custom_id``, ``request_counts`` that disagree with the files,
``usage`` that is not the lines' sum, and an error line for a row that could have run."""

from __future__ import annotations

import pytest
from openai.types import Batch

from load.chaos import FAULTS, ChaosConfig
from load.chaos_load import kv_row, legit_failure, waves
from load.chaos_openai import OpenAIRun, user_view
from load.openai_check import input_rows
from load.workload import generated


def out_line(cid: str, prompt: int = 3, completion: int = 5) -> dict:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    body = {"object": "chat.completion", "id": "x", "created": 1, "model": "m", "usage": usage, "choices": []}
    return {
        "id": f"batch_req_{cid}",
        "custom_id": cid,
        "response": {"status_code": 200, "body": body},
        "error": None,
    }


def err_line(cid: str) -> dict:
    return {
        "id": f"batch_req_{cid}",
        "custom_id": cid,
        "response": None,
        "error": {"code": "x", "message": "y"},
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
    assert legit_failure("kv-grpc-0") and legit_failure("sole-0") and not legit_failure(ids[1])


def test_the_load_comes_in_one_wave_per_fault_plus_one_and_the_outage_outlasts_two_leases(tmp_path):
    w = waves(100, len(FAULTS) + 1, seed=0, max_tokens=8)
    assert len(w) == 12 and sum(map(len, w)) == 100 and min(map(len, w)) == 8
    assert len({it.id for wave in w for it in wave}) == 100
    c = ChaosConfig(run_dir=tmp_path, lease_s=3.0)
    assert c.outage_s == c.stop_s == 8.0
    with pytest.raises(ValueError, match="twice the lease"):
        ChaosConfig(run_dir=tmp_path, lease_s=3.0, outage_s=5.0)
    with pytest.raises(ValueError, match="one wave per fault"):
        ChaosConfig(run_dir=tmp_path, queries=5)
