"""The finalizer of HTTP batches against a real Redis and a real file store (issue 31, finding 4):
a store that cannot be written makes it retry with backoff, past the five passes after which it
used to fail the batch and delete its files, until the store heals; it gives up only when the
batch's retention ends before its next try. Passes are run one by one with an injected clock."""

from __future__ import annotations

import json
import os

from gateway.http_api import batches as ob
from gateway.http_api.files import LocalFileStore, new_file_id, read_lines
from gateway.http_api.finalizer import Finalizer, file_id_of, retry_delay
from gateway.http_api.format import COMPLETIONS
from gateway.status.metrics import GatewayMetrics
from tests.harness import Clock
from workqueue import QueuedQuery, WorkQueue, connect, keys

ROWS = [{"custom_id": f"c{i}", "url": COMPLETIONS, "body": {"prompt": f"hello {i}"}} for i in range(3)]


def finished_batch(queue: WorkQueue, store: LocalFileStore, batch_id: str) -> str:
    """An HTTP batch of three rows, finished: c0 and c1 answered, c2 failed. Returns its input file id."""
    input_id = new_file_id()
    store.put(input_id, "in.jsonl", "batch", [("".join(json.dumps(r) + "\n" for r in ROWS)).encode()])
    names = ob.names_of(read_lines(store, input_id))
    qids = {custom: qid for qid, (custom, _) in names.items()}
    queries = [QueuedQuery(batch_id, qids[r["custom_id"]], "hello", 8, 2, 4.0) for r in ROWS]
    assert queue.create_batch(batch_id, [(q, "a") for q in queries])
    ob.create_record(queue, batch_id, input_id, COMPLETIONS, "24h")
    for c in queue.claim("a", 3, "w", 30):
        failed = c.query.query_id == qids["c2"]
        result = {"batch_id": batch_id, "query_id": c.query.query_id, "text": "ok", "prompt_tokens": 2,
                  "completion_tokens": 1, "finish_reason": "error" if failed else "stop",
                  "error": "boom" if failed else ""}  # fmt: skip
        queue.complete(c.query.gid, result, "failed" if failed else "completed", 1)
    assert queue.batch(batch_id).status == "completed"
    return input_id


def sample(metrics: GatewayMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


def retry_passes(fin: Finalizer, clock: Clock, batch_id: str, n: int) -> None:
    """``n`` passes that fail, each when the batch's retry is due (and one early pass that waits)."""
    key = ob.record_key(batch_id)
    for i in range(1, n + 1):
        assert fin.tick() == 0
        rec = fin.queue.r.hgetall(key)
        assert int(rec["finalize_failures"]) == i and "finalize_error" not in rec
        assert float(rec["finalize_retry_at"]) - clock.now == retry_delay(i)
        assert fin.tick() == 0 and int(fin.queue.r.hget(key, "finalize_failures")) == i  # not due yet
        clock.now = float(rec["finalize_retry_at"])


def test_an_unwritable_store_is_retried_with_backoff_until_it_heals(redis_url, tmp_path):
    queue, store, clock, metrics = (
        WorkQueue(connect(redis_url)),
        LocalFileStore(tmp_path),
        Clock(1_000_000.0),
        GatewayMetrics(),
    )
    finished_batch(queue, store, "batch_a")
    blocker = tmp_path / file_id_of("batch_a", "output")
    blocker.mkdir()  # the output file's path is a directory: every write of it fails, even as root
    fin = Finalizer(queue, store, metrics=metrics, clock=clock)
    retry_passes(fin, clock, "batch_a", 8)  # the old finalizer failed the batch at its fifth pass
    assert [retry_delay(i) for i in (1, 2, 8, 30)] == [0.5, 1.0, 64.0, 300.0]
    assert queue.r.sismember(ob.PENDING, "batch_a")
    assert sample(metrics, "fleetbatch_finalize_failed_passes_total") == 8
    assert sample(metrics, "fleetbatch_finalize_retrying_batches") == 1
    blocker.rmdir()  # the store heals
    assert fin.tick() == 1
    rec = queue.r.hgetall(ob.record_key("batch_a"))
    assert "finalize_error" not in rec and not queue.r.sismember(ob.PENDING, "batch_a")
    assert sample(metrics, "fleetbatch_finalize_retrying_batches") == 0
    out = [json.loads(x) for x in read_lines(store, rec["output_file_id"])]
    err = [json.loads(x) for x in read_lines(store, rec["error_file_id"])]
    assert sorted(x["custom_id"] for x in out) == ["c0", "c1"] and [x["custom_id"] for x in err] == ["c2"]
    assert (int(rec["input_tokens"]), int(rec["output_tokens"])) == (4, 2)


def test_it_gives_up_when_the_retention_ends_before_the_next_try(redis_url, tmp_path):
    queue, store, clock, metrics = (
        WorkQueue(connect(redis_url), retention_s=60),
        LocalFileStore(tmp_path),
        Clock(1_000_000.0),
        GatewayMetrics(),
    )
    finished_batch(queue, store, "batch_b")
    os.mkdir(tmp_path / file_id_of("batch_b", "output"))
    fin = Finalizer(queue, store, metrics=metrics, clock=clock)
    retry_passes(fin, clock, "batch_b", 7)  # the 7th waits 32 s, within the 60 s the results are kept
    assert fin.tick() == 0  # the 8th would wait 64 s: past the retention
    rec = queue.r.hgetall(ob.record_key("batch_b"))
    assert "could not be written" in rec["finalize_error"] and rec["output_file_id"] == ""
    assert not queue.r.sismember(ob.PENDING, "batch_b")
    assert sample(metrics, "fleetbatch_finalize_gave_up_total") == 1


def test_every_request_has_exactly_one_line_across_the_two_files(redis_url, tmp_path):
    """A result row written twice gives one line; a request with no result (its intake list was
    lost) still gets its line, in the error file: each custom_id exactly once, whatever Redis holds."""
    queue, store = WorkQueue(connect(redis_url)), LocalFileStore(tmp_path)
    finished_batch(queue, store, "batch_c")
    results = keys.results("batch_c")
    rows = queue.r.lrange(results, 0, -1)
    queue.r.rpush(results, rows[0])  # c0's row twice
    queue.r.lrem(results, 1, rows[1])  # c1's row gone
    fin = Finalizer(queue, store)
    assert fin.tick() == 1
    rec = queue.r.hgetall(ob.record_key("batch_c"))
    out = [json.loads(x) for x in read_lines(store, rec["output_file_id"])]
    err = [json.loads(x) for x in read_lines(store, rec["error_file_id"])]
    assert sorted(line["custom_id"] for line in out + err) == ["c0", "c1", "c2"]
    assert [line["custom_id"] for line in out] == ["c0"]
    missing = next(line for line in err if line["custom_id"] == "c1")
    assert missing["response"] is None and "never run" in missing["error"]["message"]
