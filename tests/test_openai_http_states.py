"""States of HTTP batches at their edges, against a live gateway (real Redis; the engine's side
done through the queue API): output files over the upload limit; a batch that cannot be
finalized is retried without holding up the others; a record whose gateway batch is being created;
a submission that fails after the gateway batch exists; cancelling a batch that is over.
"""

from __future__ import annotations

import os

import openai
import pytest
import redis
from openai import OpenAI

from gateway.http_api import batches as ob
from gateway.http_api.format import COMPLETIONS
from gateway.http_api.retention import expire_orphan
from tests.harness import wait_until
from tests.openai_http_helpers import KEY, complete_claimed, http_gateway, jsonl, wait_final
from workqueue import WorkQueue, connect


def _rows(n: int, tag: str = "r") -> bytes:
    return jsonl([{"custom_id": f"{tag}{i}", "body": {"prompt": "hello"}} for i in range(n)])


@pytest.fixture
def idle(redis_url, tmp_path):
    """A gateway with its HTTP front on cluster ``idle`` (no engine: the test completes the
    queries), uploads bounded to 4096 bytes; (client, queue, files directory)."""
    gateway = http_gateway(
        redis_url, tmp_path / "files", cluster="idle", max_request_bytes=4096, max_queued_per_client=100
    )
    gateway.start()
    try:
        client = OpenAI(base_url=gateway.config.http_url, api_key=KEY, max_retries=0)
        yield client, WorkQueue(connect(redis_url)), tmp_path / "files"
    finally:
        gateway.stop()


def test_an_output_file_over_the_upload_limit_is_written(idle):
    """The limit bounds uploads, not the finalizer's output files."""
    client, queue, _ = idle
    f = client.files.create(file=("s.jsonl", _rows(3)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=COMPLETIONS, completion_window="24h")
    assert complete_claimed(queue, "idle", 3, text="x" * 3000) == 3
    done = wait_final(client, batch.id, 30)
    assert done.status == "completed" and done.output_file_id
    assert client.files.retrieve(done.output_file_id).bytes > 9000


def test_a_batch_that_cannot_be_finalized_is_retried_and_holds_up_no_other(idle):
    """Its input file gone from the store: it stays ``finalizing`` and is retried with backoff (not
    failed after a few passes, as it was: issue 31); the other batches are finalized meanwhile, and
    it is finalized once the file is back. Giving up at the end of the retention:
    ``test_openai_finalizer.py``."""
    client, queue, files = idle
    lost = client.files.create(file=("lost.jsonl", _rows(2, "l")), purpose="batch")
    kept = client.files.create(file=("kept.jsonl", _rows(2, "k")), purpose="batch")
    bad = client.batches.create(input_file_id=lost.id, endpoint=COMPLETIONS, completion_window="24h")
    good = client.batches.create(input_file_id=kept.id, endpoint=COMPLETIONS, completion_window="24h")
    saved = (files / lost.id).read_bytes()
    os.remove(files / lost.id)
    assert complete_claimed(queue, "idle", 4) == 4
    assert wait_final(client, good.id, 30).status == "completed"
    record = ob.record_key(bad.id)
    wait_until(lambda: int(queue.r.hget(record, "finalize_failures") or 0) >= 2, 30, "two failed passes")
    assert client.batches.retrieve(bad.id).status == "finalizing"
    assert queue.r.sismember(ob.PENDING, bad.id) and not queue.r.hget(record, "finalize_error")
    (files / lost.id).write_bytes(saved)  # the store heals
    done = wait_final(client, bad.id, 60)
    assert done.status == "completed" and done.output_file_id and done.request_counts.completed == 2


def test_a_record_whose_gateway_batch_is_being_created_is_validating(idle):
    """SubmitBatch is still running: the record is there, the gateway batch not yet."""
    client, queue, _ = idle
    ob.create_record(queue, "batch_creating", "file-" + "0" * 24, COMPLETIONS, "24h")
    got = client.batches.retrieve("batch_creating")
    assert got.status == "validating" and got.expired_at is None
    assert [b.status for b in client.batches.list()] == ["validating"]
    expire_orphan(queue, "batch_creating", 0)  # the finalizer's verdict when it never appears
    assert client.batches.retrieve("batch_creating").status == "expired"


def test_a_batch_created_before_its_submission_failed_keeps_its_record(idle, monkeypatch):
    """The gateway batch exists when SubmitBatch fails (here: the connection drops after the
    creating transaction ran, its reply lost): the record stays, the answer is the batch, and it is
    finalized as any other. (The per-client cap's write, whose refusal the test used, now goes in
    the creating transaction.)"""
    client, queue, _ = idle
    f = client.files.create(file=("c.jsonl", _rows(2)), purpose="batch")
    create_batch = WorkQueue.create_batch

    def reply_lost(self, *args, **kw):
        create_batch(self, *args, **kw)
        raise redis.ConnectionError("the connection dropped after EXEC")

    monkeypatch.setattr(WorkQueue, "create_batch", reply_lost)
    batch = client.batches.create(input_file_id=f.id, endpoint=COMPLETIONS, completion_window="24h")
    monkeypatch.undo()
    assert batch.status == "in_progress" and batch.input_file_id == f.id
    assert [b.id for b in client.batches.list()] == [batch.id]
    assert complete_claimed(queue, "idle", 2) == 2
    done = wait_final(client, batch.id, 30)
    assert done.status == "completed" and done.output_file_id


def test_cancelling_a_batch_that_is_over_is_409_and_changes_nothing(idle):
    client, queue, _ = idle
    f = client.files.create(file=("o.jsonl", _rows(1)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=COMPLETIONS, completion_window="24h")
    assert complete_claimed(queue, "idle", 1) == 1
    assert wait_final(client, batch.id, 30).status == "completed"
    with pytest.raises(openai.ConflictError) as e:
        client.batches.cancel(batch.id)
    assert e.value.status_code == 409 and "status 'completed'" in e.value.message
    assert set(e.value.body) == {"message", "type", "param", "code"}
    after = client.batches.retrieve(batch.id)
    assert after.status == "completed" and after.cancelling_at is None
    running = client.batches.create(input_file_id=f.id, endpoint=COMPLETIONS, completion_window="24h")
    first = client.batches.cancel(running.id)
    assert first.cancelling_at and wait_final(client, running.id, 30).status == "cancelled"
    again = client.batches.cancel(running.id)  # cancelled already: the object, unchanged
    assert again.status == "cancelled" and again.cancelling_at == first.cancelling_at


def test_a_cancel_while_the_batch_is_created_is_kept_and_applied(idle, monkeypatch):
    """Issue [4/7], finding 6: while the input file was read, the record said ``validating`` and a cancel
    answered 404 and was lost; the batch then ran in full. Now the cancel is recorded, answered
    ``cancelling``, and applied as soon as the gateway batch exists."""
    import threading

    client, queue, _ = idle
    f = client.files.create(file=("slow.jsonl", _rows(3, "s")), purpose="batch")
    reading, go_on = threading.Event(), threading.Event()
    scan = ob.scan_input

    def slow_read(*args, **kw):  # a large file: the creation is still reading it
        reading.set()
        assert go_on.wait(60)
        return scan(*args, **kw)

    monkeypatch.setattr(ob, "scan_input", slow_read)
    created: list = []
    creator = threading.Thread(
        target=lambda: created.append(
            client.batches.create(input_file_id=f.id, endpoint=COMPLETIONS, completion_window="24h")
        )
    )
    creator.start()
    assert reading.wait(30)
    (being,) = client.batches.list()
    assert being.status == "validating"
    assert client.batches.cancel(being.id).status == "cancelling"  # was a 404
    go_on.set()
    creator.join(60)
    assert created and created[0].id == being.id
    done = wait_final(client, being.id, 30)
    assert done.status == "cancelled" and done.request_counts.completed == 0
    assert queue.claim("idle", 10, "w", 30) == []  # nothing of it runs
