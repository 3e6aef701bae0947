"""The OpenAI-compatible HTTP front, driven by the official ``openai`` package against a live gateway.

Real Redis, the real gateway (gRPC and HTTP in one process) and a real engine process: upload,
create, poll, download and check every output line against OpenAI's batch output shape; usage
and in_progress_at; cancel; finalizing after a gateway restart; records and files expiring with
the batch. Files, keys and errors: ``test_openai_http_files.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict

import grpc
import openai
import pytest
from openai import OpenAI

from gateway.http_api import batches as ob
from gateway.http_api.format import CHAT, COMPLETIONS
from gateway.http_api.objects import batch_object
from gateway.http_api.retention import EXPIRE
from gateway.http_api.s3_files import S3FileStore
from load.soaks.openai_check import batch_problems
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import REPO, start_engine, wait_until
from tests.openai_http_helpers import ENGINE_ARGS, KEY, check_output_line, http_gateway, jsonl, wait_final
from workqueue import QueuedQuery, WorkQueue, connect, keys


@pytest.fixture(params=["directory", "s3"])
def files_at(request, tmp_path) -> str:
    """Where the test's gateways keep their files: a directory, or a prefix of the session's S3 server."""
    return str(tmp_path / "files") if request.param == "directory" else request.getfixturevalue("s3_files")


def test_output_files_are_written_after_a_gateway_restart(redis_url, files_at):
    """The batch finishes while no gateway runs; the next gateway finalizes it from Redis."""
    first = http_gateway(redis_url, files_at, cluster="idle")
    first.start()
    client = OpenAI(base_url=first.config.http_url, api_key=KEY, max_retries=0)
    rows = [
        {"custom_id": f"r{i}", "url": CHAT, "body": {"messages": [{"role": "user", "content": "hi"}]}}
        for i in range(3)
    ]
    f = client.files.create(file=("r.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    first.stop()
    queue = WorkQueue(connect(redis_url))
    for c in queue.claim("idle", 3, "w", 30):  # the engine's side, through the queue API
        result = {"batch_id": c.query.batch_id, "query_id": c.query.query_id, "text": "ok",
                  "prompt_tokens": 3, "completion_tokens": 1, "finish_reason": "stop"}  # fmt: skip
        queue.complete(c.query.gid, result, "completed", 1)
    second = http_gateway(redis_url, files_at, cluster="idle")
    second.start()
    try:
        client = OpenAI(base_url=second.config.http_url, api_key=KEY, max_retries=0)
        done = wait_final(client, batch.id, 30)
        assert done.status == "completed"
        lines = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in lines) == ["r0", "r1", "r2"]
        for line in lines:
            check_output_line(line, CHAT, {"r0", "r1", "r2"})
        assert (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens) == (9, 3, 12)
    finally:
        second.stop()


def test_grpc_batches_are_not_the_http_fronts(redis_url, tmp_path):
    """Neither retrievable, cancellable nor listed over HTTP (404, as an unknown id): the HTTP key
    is one for all and the batch is a gRPC client's (issue 31's review; they were retrievable)."""
    gateway = http_gateway(redis_url, tmp_path / "files", cluster="idle")
    address = gateway.start()
    try:
        with grpc.insecure_channel(address) as ch:
            req = pb.SubmitBatchRequest(batch_id="over-grpc")
            req.queries.add(id="q0", prompt="hello", max_tokens=4)
            pb_grpc.BatchServiceStub(ch).SubmitBatch(req, timeout=30)
        client = OpenAI(base_url=gateway.config.http_url, api_key=KEY, max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve("over-grpc")
        with pytest.raises(openai.NotFoundError):
            client.batches.cancel("over-grpc")
        assert client.batches.list().data == []
    finally:
        gateway.stop()


def test_in_progress_at_is_when_the_batch_left_validating(redis_url):
    """A batch in background intake is validating until its first chunk lands; one created whole is
    in progress from the queue's own creation time."""
    queue = WorkQueue(connect(redis_url))

    def obj(batch_id: str) -> dict:
        info, rec = queue.batch(batch_id), queue.r.hgetall(ob.record_key(batch_id))
        ob.note_progress(queue, batch_id, info, rec)
        return batch_object(batch_id, info, rec)

    ob.create_record(queue, "batch_big", "file-in", CHAT, "24h")
    assert queue.accept_batch("batch_big", ["{}"])
    assert obj("batch_big")["status"] == "validating" and obj("batch_big")["in_progress_at"] is None
    time.sleep(1.1)
    landed = time.time()
    q = QueuedQuery("batch_big", "q0", "hello", 4, 1, 4.0)
    assert queue.take_intake("batch_big", "me", 30)
    assert queue.enqueue_chunk("batch_big", "me", 0, [(q.gid, json.dumps(asdict(q)), 5.0, "a")], 30) == 1
    seen = obj("batch_big")
    assert seen["status"] == "in_progress" and seen["in_progress_at"] >= int(landed) > seen["created_at"]
    time.sleep(1.1)
    assert obj("batch_big")["in_progress_at"] == seen["in_progress_at"]  # recorded once
    ob.create_record(queue, "batch_small", "file-in", CHAT, "24h")
    assert queue.create_batch("batch_small", [(QueuedQuery("batch_small", "q0", "hi", 4, 1, 4.0), "a")])
    assert obj("batch_small")["in_progress_at"] == int(queue.batch("batch_small").created_at)


def test_records_and_files_follow_the_batch_retention(redis_url, files_at):
    """With a retention of 3 s, a finished HTTP batch's record, list entry and files go when its
    gateway batch does (in object storage too: their objects are gone); a file no batch used stays."""
    gateway = http_gateway(redis_url, files_at, cluster="idle", retention_s=3)
    gateway.start()
    queue = WorkQueue(connect(redis_url))
    try:
        client = OpenAI(base_url=gateway.config.http_url, api_key=KEY, max_retries=0)
        rows = [{"custom_id": f"k{i}", "body": {"prompt": "hello"}} for i in range(3)]
        f = client.files.create(file=("k.jsonl", jsonl(rows)), purpose="batch")
        unused = client.files.create(file=("u.jsonl", jsonl(rows)), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint=COMPLETIONS, completion_window="24h")
        for i, c in enumerate(queue.claim("idle", 3, "w", 30)):
            ok = i < 2
            result = {"batch_id": c.query.batch_id, "query_id": c.query.query_id, "text": "ok",
                      "prompt_tokens": 3, "completion_tokens": 2, "finish_reason": "stop" if ok else "error",
                      "error": None if ok else "boom"}  # fmt: skip
            queue.complete(c.query.gid, result, "completed" if ok else "failed", 2)
        done = wait_final(client, batch.id, 30)
        assert done.status == "completed" and done.output_file_id and done.error_file_id
        assert (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens) == (6, 4, 10)
        key = ob.record_key(batch.id)
        assert (
            0 < queue.r.pttl(key) <= 3000
            and abs(queue.r.pttl(key) - queue.r.pttl(keys.batch(batch.id))) < 500
        )
        assert batch.id in [b.id for b in client.batches.list()]
        files = (f.id, done.output_file_id, done.error_file_id)
        assert all(queue.r.zscore(EXPIRE, "f:" + x) for x in files)

        def expired() -> bool:
            try:
                client.batches.retrieve(batch.id)
                return False
            except openai.NotFoundError:
                return queue.r.zcard(EXPIRE) == 0

        wait_until(expired, 20, "the batch and its files to expire")
        for x in files:
            with pytest.raises(openai.NotFoundError):
                client.files.retrieve(x)
        assert client.files.retrieve(unused.id).id == unused.id
        assert [x.id for x in client.files.list()] == [unused.id]
        if files_at.startswith("s3://"):
            store = S3FileStore(files_at)
            listed = store.s3.list_objects_v2(Bucket=store.bucket, Prefix=store.prefix + "/")["Contents"]
            assert sorted(o["Key"].rsplit("/", 1)[1] for o in listed) == [unused.id, unused.id + ".json"]
        assert batch.id not in [b.id for b in client.batches.list()]
        assert queue.r.zscore(ob.LIST, batch.id) is None and not queue.r.sismember(ob.PENDING, batch.id)
        assert not queue.r.exists(key) and queue.batch(batch.id) is None
    finally:
        gateway.stop()


@pytest.fixture(scope="module")
def live(redis_server, tmp_path_factory):
    """One gateway with an HTTP front and one real engine, for the tests at the end of the module
    (they come last: the engine, on the module's Redis, would serve the other tests' batches)."""
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    tmp = tmp_path_factory.mktemp("openai")
    engine = start_engine("a", redis_server.url, tmp, *ENGINE_ARGS)
    gateway = http_gateway(redis_server.url, tmp / "files")
    address = gateway.start()
    queue = WorkQueue(connect(redis_server.url))
    try:
        wait_until(lambda: queue.clusters(["a"])[0].alive, 240, "the engine's heartbeat")
        yield OpenAI(base_url=gateway.config.http_url, api_key=KEY, max_retries=0), address
    finally:
        gateway.stop()
        engine.terminate()
        engine.wait(timeout=30)


def test_the_whole_flow_with_the_openai_client(live):
    client, address = live
    rows = [
        {"custom_id": f"chat-{i}", "method": "POST", "url": CHAT,
         "body": {"model": "m1", "max_tokens": 6 + i,
                  "messages": [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": f"Tell me about rivers, part {i}."}]}}
        for i in range(6)
    ]  # fmt: skip
    f = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    assert f.purpose == "batch" and f.bytes == len(jsonl(rows))
    assert client.files.retrieve(f.id).filename == "in.jsonl"
    assert client.files.content(f.id).read() == jsonl(rows)
    batch = client.batches.create(
        input_file_id=f.id, endpoint=CHAT, completion_window="24h", metadata={"team": "t"}
    )
    assert batch.status in ("validating", "in_progress") and batch.input_file_id == f.id
    done = wait_final(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == done.request_counts.completed == 6
    assert done.request_counts.failed == 0 and done.error_file_id is None
    assert done.completed_at and done.finalizing_at and done.metadata == {"team": "t"}
    lines = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(r["custom_id"] for r in rows)
    for line in lines:
        check_output_line(line, CHAT, {r["custom_id"] for r in rows})
        assert line["response"]["body"]["model"] == "m1"
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    usage = [line["response"]["body"]["usage"] for line in lines]
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in usage) > 0
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in usage) > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    assert done.created_at <= done.in_progress_at <= done.completed_at
    assert batch_problems(done, lines) == []  # what `fleetbatch loadgen openai-check` checks
    with grpc.insecure_channel(address) as ch:  # the same batch over gRPC
        same = pb_grpc.BatchServiceStub(ch).GetBatch(pb.GetBatchRequest(batch_id=batch.id), timeout=10)
    assert same.status == pb.COMPLETED and same.request_counts.completed == 6
    assert batch.id in [b.id for b in client.batches.list(limit=100)]


def test_completions_with_custom_ids_that_are_not_query_ids(live):
    client, _ = live
    rows = [
        {"custom_id": cid, "method": "POST", "url": COMPLETIONS, "body": {"prompt": "Once upon", "max_tokens": 4}}
        for cid in ("req:1", "req 2", "über-3")
    ]  # fmt: skip
    f = client.files.create(file=("c.jsonl", jsonl(rows)), purpose="batch")
    done = wait_final(
        client, client.batches.create(input_file_id=f.id, endpoint=COMPLETIONS, completion_window="24h").id
    )
    assert done.status == "completed"
    lines = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(r["custom_id"] for r in rows)
    for line in lines:
        check_output_line(line, COMPLETIONS, {r["custom_id"] for r in rows})


def test_cancel(live):
    client, _ = live
    rows = [
        {"custom_id": f"long-{i}", "url": CHAT,
         "body": {"max_tokens": 400, "messages": [{"role": "user", "content": f"Write a long essay number {i}."}]}}
        for i in range(40)
    ]  # fmt: skip
    f = client.files.create(file=("long.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_final(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert counts.total == 40 and counts.completed + counts.failed == 40 and counts.failed > 0
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert len(errors) == counts.failed
    for line in errors:
        check_output_line(line, CHAT, {r["custom_id"] for r in rows})
        assert line["error"]["code"] == "cancelled"


@pytest.mark.slow
def test_loadgen_openai_check_runs_the_flow_against_gateway_up(tmp_path):
    """`fleetbatch gateway up` starts the HTTP front and records it in gateway.json; `fleetbatch loadgen openai-check` uses it."""
    cmd = [sys.executable, "-m", "load.cli", "openai-check", "-n", "12", "--dataset", "generated",
           "--max-tokens", "16", "--endpoint", COMPLETIONS, "--run-dir", str(tmp_path / "run"),
           "--gateway-arg=--num-clusters", "--gateway-arg=2"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["requests"] == result["completed"] == result["output_lines_valid"] == 12, result
    assert result["status"] == result["grpc_status"] == "completed" and result["problems"] == []
    assert "OpenAI-compatible API: http://127.0.0.1:" in (tmp_path / "run" / "up.log").read_text()
