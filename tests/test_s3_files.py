"""The HTTP front's files in S3-compatible object storage (issue 50, build item 3), against a real S3 server
process (moto's standalone server, :mod:`tests.s3_server`): the store's own operations (streamed, multipart
past one part, nothing left by a refused upload), and a large batch created from a file in S3, sent to the
gateway in several messages, its bad line named, then finalized into S3 with every ``custom_id`` once."""

from __future__ import annotations

import json
import os

import pytest
from openai import OpenAI

from gateway.http_api import batches as ob
from gateway.http_api.files import TooLarge, new_file_id, read_lines
from gateway.http_api.finalizer import Finalizer
from gateway.http_api.format import COMPLETIONS
from gateway.http_api.s3_files import S3FileStore, parse_url
from gateway.http_api.stores import open_store
from tests.openai_http_helpers import KEY, complete_claimed, http_gateway, jsonl, wait_final
from tests.test_openai_finalizer import ROWS, finished_batch
from workqueue import WorkQueue, connect, keys

MB = 1 << 20


def pieces(data: bytes, size: int = MB):
    return (data[i : i + size] for i in range(0, len(data), size))


def keys_under(store: S3FileStore) -> list[str]:
    got = store.s3.list_objects_v2(Bucket=store.bucket, Prefix=store.prefix + "/").get("Contents", [])
    return sorted(o["Key"][len(store.prefix) + 1 :] for o in got)


def test_urls_name_a_bucket_and_a_prefix():
    assert parse_url("s3://b/some/prefix/") == ("b", "some/prefix")
    assert parse_url("s3://b") == ("b", "")
    for bad in ("s3:///p", "/tmp/dir"):
        with pytest.raises(ValueError):
            parse_url(bad)


def test_files_go_up_whole_or_in_parts_and_come_back_streamed(s3_files):
    store = S3FileStore(s3_files, part_bytes=5 * MB)  # S3's smallest part
    assert isinstance(open_store(s3_files), S3FileStore)
    small, large = new_file_id(), new_file_id()
    store.put(small, "s.jsonl", "batch", [b'{"a": 1}\n', b'{"b": 2}'])
    data = os.urandom(11 * MB + 5)  # three parts: 5, 5 and 1 MB
    info = store.put(large, "l.bin", "batch_output", pieces(data))
    assert (info.bytes, info.filename, info.purpose) == (len(data), "l.bin", "batch_output")
    assert store.info(large) == info
    assert [len(c) for c in store.chunks(large)][:2] == [MB, MB]  # a stream of chunks, not one body
    assert b"".join(store.chunks(large)) == data
    assert list(read_lines(store, small)) == [b'{"a": 1}', b'{"b": 2}']
    assert sorted(f.id for f in store.files()) == sorted([small, large])
    store.put(small, "s2.jsonl", "batch", [b"x"])  # the same id again: replaced
    assert b"".join(store.chunks(small)) == b"x" and store.info(small).filename == "s2.jsonl"
    assert store.delete(large) and store.info(large) is None and not store.delete(large)
    with pytest.raises(FileNotFoundError):
        list(store.chunks(large))
    for never_issued in ("file-x", "file-" + "0" * 24 + ".json", "../etc"):
        assert store.info(never_issued) is None and not store.delete(never_issued)
    assert keys_under(store) == sorted([small, small + ".json"])


def test_a_read_cut_short_resumes_where_it_was(s3_server, s3_files, caplog):
    """The connection of a GET breaks after 1.5 MB of a 3 MB object: ``chunks`` goes on from that byte
    (``Range``, ``If-Match`` on the ETag) and the reader sees every byte once."""
    store = S3FileStore(s3_files)
    file_id, data = new_file_id(), os.urandom(3 * MB)
    store.put(file_id, "d.bin", "batch", pieces(data))
    s3_server.cut_next_read(3 * MB // 2)
    assert b"".join(store.chunks(file_id)) == data
    assert s3_server.cuts() == 1 and f"broke at byte {3 * MB // 2}" in caplog.text


def test_an_upload_over_the_limit_leaves_no_object_and_no_open_upload(s3_files):
    store = S3FileStore(s3_files, part_bytes=5 * MB)
    file_id = new_file_id()
    with pytest.raises(TooLarge):
        store.put(file_id, "big", "batch", pieces(bytes(12 * MB)), max_bytes=11 * MB)
    assert store.info(file_id) is None and keys_under(store) == []
    assert not store.s3.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix).get("Uploads")


def test_a_bucket_that_cannot_be_reached_fails_at_the_start(s3_files):
    with pytest.raises(OSError, match="cannot be listed"):
        open_store("s3://no-such-bucket/p")


def test_the_finalizer_writes_each_custom_id_once_into_s3(redis_url, s3_files):
    """The finalizer's exactly-once test of the local store (tests/test_openai_finalizer.py), on S3."""
    queue, store = WorkQueue(connect(redis_url)), S3FileStore(s3_files)
    finished_batch(queue, store, "batch_s3")
    results = keys.results("batch_s3")
    rows = queue.r.lrange(results, 0, -1)
    queue.r.rpush(results, rows[0])  # c0's row twice
    queue.r.lrem(results, 1, rows[1])  # c1's row gone
    assert Finalizer(queue, store).tick() == 1
    rec = queue.r.hgetall(ob.record_key("batch_s3"))
    out = [json.loads(x) for x in read_lines(store, rec["output_file_id"])]
    err = [json.loads(x) for x in read_lines(store, rec["error_file_id"])]
    assert sorted(x["custom_id"] for x in out + err) == [r["custom_id"] for r in ROWS]


def test_a_large_batch_is_created_from_s3_in_parts_and_finalized_there(redis_url, s3_files, monkeypatch):
    """Past the intake's ``sync_max_queries`` the input file is read twice as a stream and sent in many
    messages (a few hundred bytes each here); a problem only the gateway finds (the prompt's tokens)
    names its line in a late message; the valid file's batch runs and is finalized into S3."""
    monkeypatch.setenv("FLEETBATCH_INTAKE_SYNC_MAX", "10")
    monkeypatch.setattr(ob, "PART_BYTES", 300)
    gateway = http_gateway(redis_url, s3_files, cluster="idle", max_prompt_tokens=64)
    gateway.start()
    try:
        client = OpenAI(base_url=gateway.config.http_url, api_key=KEY, max_retries=0)
        rows = [{"custom_id": f"k{i}", "body": {"prompt": f"hello {i}", "max_tokens": 2}} for i in range(40)]
        bad = [*rows[:33], {"custom_id": "long", "body": {"prompt": "word " * 200}}, *rows[33:]]
        f = client.files.create(file=("bad.jsonl", jsonl(bad)), purpose="batch")
        failed = client.batches.create(input_file_id=f.id, endpoint=COMPLETIONS, completion_window="24h")
        assert failed.status == "failed", failed
        assert [(e.line, "tokens" in e.message) for e in failed.errors.data] == [(34, True)]
        f = client.files.create(file=("ok.jsonl", jsonl(rows)), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint=COMPLETIONS, completion_window="24h")
        queue = WorkQueue(connect(redis_url))
        assert int(queue.r.hget(keys.batch(batch.id), "intake_total")) == 40  # accepted for the intake
        done = 0
        while done < 40:
            done += complete_claimed(queue, "idle", 40 - done)
        final = wait_final(client, batch.id, 60)
        assert final.status == "completed" and final.request_counts.completed == 40
        out = [json.loads(x) for x in client.files.content(final.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out) == sorted(r["custom_id"] for r in rows)
        assert final.output_file_id in keys_under(S3FileStore(s3_files))
    finally:
        gateway.stop()


def test_a_store_that_fails_is_a_503_naming_it(redis_url, s3_files):
    """Object storage that refuses (here: the bucket deleted under the gateway) is HTTP 503, retry later,
    naming the store and what it could not do; never a 500."""
    import boto3
    import openai

    s3, bucket = boto3.client("s3"), f"gone-{os.getpid()}-{new_file_id()[-8:]}"
    s3.create_bucket(Bucket=bucket)
    gateway = http_gateway(redis_url, f"s3://{bucket}/p", cluster="idle")
    gateway.start()
    try:
        client = OpenAI(base_url=gateway.config.http_url, api_key=KEY, max_retries=0)
        f = client.files.create(file=("a.jsonl", jsonl(ROWS)), purpose="batch")
        for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=o["Key"])
        s3.delete_bucket(Bucket=bucket)
        calls = {
            "could not list its files": client.files.list,
            f"could not read the file object of {f.id}": lambda: client.files.retrieve(f.id),
            "could not store": lambda: client.files.create(file=("b.jsonl", jsonl(ROWS)), purpose="batch"),
        }
        for what, call in calls.items():
            with pytest.raises(openai.APIStatusError) as e:
                call()
            assert e.value.status_code == 503 and f"s3://{bucket}/p {what}" in str(e.value), str(e.value)
    finally:
        gateway.stop()
