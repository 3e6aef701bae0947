"""An OpenAI batch whose completion window ends before its rows ran, through the HTTP front (real Redis, a live
gateway; the engine's side done through the queue API): it reads ``expired``, its output file keeps the finished
rows, its error file has one ``batch_expired`` line per row that never ran, and the counts add up. The window
and the priority as this gateway's extensions, read back in the ``fleetbatch`` field."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from gateway.http_api.format import COMPLETIONS
from tests.harness import wait_until
from tests.openai_http_helpers import (
    KEY,
    check_output_line,
    complete_claimed,
    http_gateway,
    jsonl,
    wait_final,
)
from workqueue import WorkQueue, connect


@pytest.fixture
def idle(redis_url, tmp_path):
    gateway = http_gateway(redis_url, tmp_path / "files", cluster="idle")
    gateway.start()
    try:
        yield (
            OpenAI(base_url=gateway.config.http_url, api_key=KEY, max_retries=0),
            WorkQueue(connect(redis_url)),
        )
    finally:
        gateway.stop()


def _lines(client: OpenAI, file_id: str | None) -> list[dict]:
    assert file_id
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def test_an_expired_batch_keeps_its_finished_rows_and_writes_the_rest_as_batch_expired(idle):
    client, queue = idle
    ids = {f"r{i}" for i in range(5)}
    f = client.files.create(
        file=("e.jsonl", jsonl([{"custom_id": c, "body": {"prompt": "hello"}} for c in sorted(ids)])),
        purpose="batch",
    )
    batch = client.batches.create(
        input_file_id=f.id, endpoint=COMPLETIONS, completion_window="30m", extra_body={"priority": 7}
    )
    assert batch.completion_window == "30m" and batch.expires_at == pytest.approx(
        batch.created_at + 1800, abs=2
    )
    ext = batch.model_extra["fleetbatch"]
    assert ext["priority"] == 7 and ext["deadline"] == pytest.approx(batch.created_at + 1800, abs=2)
    assert complete_claimed(queue, "idle", 2) == 2  # two rows ran; three are still queued at the deadline
    assert queue.expire_due(
        now=batch.created_at + 3600
    )  # the window ended (an hour later on the queue's clock)

    done = wait_final(client, batch.id, 30)
    assert done.status == "expired" and done.expired_at
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (5, 2, 3)
    out, err = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
    for line in out + err:
        check_output_line(line, COMPLETIONS, ids)
    assert len(out) == 2 and all(line["error"] is None for line in out)
    assert len(err) == 3 and {line["error"]["code"] for line in err} == {"batch_expired"}
    assert sorted(line["custom_id"] for line in out + err) == sorted(ids)  # every row once
    final = done.model_extra["fleetbatch"]
    assert final["at_risk"] is False and final["predicted_finish_at"] is None  # no ETA once it is over


def test_the_answer_to_a_create_carries_the_predicted_finish_and_at_risk(idle):
    client, _ = idle

    def create(window: str, n: int = 1):
        rows = [{"custom_id": f"r{i}", "body": {"prompt": "tell me about rivers " * 20}} for i in range(n)]
        f = client.files.create(file=("w.jsonl", jsonl(rows)), purpose="batch")
        return client.batches.create(input_file_id=f.id, endpoint=COMPLETIONS, completion_window=window)

    first = create("24h")
    wait_until(
        lambda: client.batches.retrieve(first.id).model_extra["fleetbatch"]["predicted_finish_at"],
        30,
        "an ETA",
    )
    loose, tight = create("2d"), create("1s", 300)  # 300 rows of ~100 tokens each: not within a second
    assert (
        loose.model_extra["fleetbatch"]["predicted_finish_at"]
        and not loose.model_extra["fleetbatch"]["at_risk"]
    )
    assert tight.model_extra["fleetbatch"]["at_risk"] is True  # said in the answer itself, not a tick later
