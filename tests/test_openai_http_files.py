"""The OpenAI-compatible HTTP front's files, keys and errors, against a live gateway (real Redis).

401 / 404 / 400 / 409 / 411 / 413 / 429 in OpenAI's error shape; list and delete files; ids the
store never issues; the key file written private.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import stat
import urllib.parse

import openai
import pytest
import redis
from openai import OpenAI

from gateway.deploy.up import http_settings, write_private
from gateway.http_api.format import CHAT, COMPLETIONS
from tests.openai_http_helpers import KEY, http_gateway, jsonl, raw_call, wait_final
from workqueue import keys
from workqueue.openai_body import PASS_THROUGH


@pytest.fixture
def bare(redis_url, tmp_path):
    """A gateway with its HTTP front, no engine (errors are found before any work runs)."""
    gateway = http_gateway(redis_url, tmp_path / "files", max_queued_per_client=3, max_request_bytes=4096)
    gateway.start()
    try:
        yield gateway.config.http_url, OpenAI(base_url=gateway.config.http_url, api_key=KEY, max_retries=0)
    finally:
        gateway.stop()


def test_a_missing_or_wrong_key_is_401_in_openais_shape(bare):
    url, _ = bare
    for key in (None, "wrong"):
        status, body = raw_call(url + "/batches", key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert set(body["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=url, api_key="wrong", max_retries=0).batches.list()


def test_unknown_ids_are_404(bare):
    url, client = bare
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    status, body = raw_call(url + "/no/such/route")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"


def _bad(client, **kw) -> openai.BadRequestError:
    args = {"endpoint": CHAT, "completion_window": "24h", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(**args)
    return e.value


def test_bad_input_is_400_naming_the_field(bare):
    """A malformed request is a 400 naming its field; a bad input file is a failed batch
    (``tests/test_openai_http_input.py``)."""
    url, client = bare
    good = client.files.create(
        file=("g.jsonl", jsonl([{"custom_id": "a", "body": {"prompt": "x"}}])), purpose="batch"
    )
    assert _bad(client, input_file_id=good.id, endpoint="/v1/embeddings").body["param"] == "endpoint"
    assert (
        _bad(client, input_file_id=good.id, completion_window="tomorrow").body["param"] == "completion_window"
    )
    functions = [
        {"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x"}], "functions": []}}
    ]
    f = client.files.create(file=("t.jsonl", jsonl(functions)), purpose="batch")
    failed = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    assert failed.status == "failed" and failed.errors.data[0].line == 1
    assert "functions" in failed.errors.data[0].message
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    status, body = raw_call(url + "/batches", data=b"not json")
    assert status == 400 and body["error"]["message"]


def test_the_grpc_limits_apply_413_and_429(bare):
    _, client = bare
    with pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=("big.jsonl", b"x" * 10_000), purpose="batch")
    assert e.value.status_code == 413
    rows = [{"custom_id": f"q{i}", "body": {"prompt": "hello"}} for i in range(4)]
    f = client.files.create(file=("four.jsonl", jsonl(rows)), purpose="batch")
    with pytest.raises(openai.RateLimitError) as e:
        client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    assert "max_queued_per_client=3" in e.value.message
    assert client.batches.list().data == []  # nothing half-created


def test_files_list_and_delete(redis_url, tmp_path):
    gateway = http_gateway(redis_url, tmp_path / "files", cluster="idle")  # no engine works on its batches
    gateway.start()
    try:
        _list_and_delete(
            gateway.config.http_url, OpenAI(base_url=gateway.config.http_url, api_key=KEY, max_retries=0)
        )
    finally:
        gateway.stop()


def _list_and_delete(url: str, client: OpenAI) -> None:
    uploads = [
        client.files.create(file=(f"f{i}.jsonl", jsonl([{"custom_id": "a", "body": {"prompt": "x"}}])), purpose="batch")
        for i in range(4)
    ]  # fmt: skip
    listed = client.files.list()
    assert listed.object == "list" and listed.has_more is False
    ids = [f.id for f in listed.data]
    assert sorted(ids) == sorted(u.id for u in uploads)
    assert [f.created_at for f in listed.data] == sorted((f.created_at for f in listed.data), reverse=True)
    assert [f.id for f in client.files.list(order="asc").data] == ids[::-1]
    page = client.files.list(limit=3)
    assert len(page.data) == 3 and page.has_more and page.last_id == ids[2]
    assert [f.id for f in client.files.list(limit=3, after=ids[2]).data] == ids[3:]
    assert [f.id for f in client.files.list(limit=1)] == ids  # the client's auto-pagination (after=)
    assert client.files.list(purpose="batch_output").data == []
    assert len(client.files.list(purpose="batch").data) == 4
    for query in ("limit=0", "limit=10001", "order=sideways", "after=file-nope"):
        status, body = raw_call(f"{url}/files?{query}")
        assert status == 400 and body["error"]["param"] == query.split("=")[0], (query, body)

    batch = client.batches.create(input_file_id=uploads[0].id, endpoint=COMPLETIONS, completion_window="24h")
    with pytest.raises(openai.ConflictError) as e:  # the finalizer still needs it
        client.files.delete(uploads[0].id)
    assert e.value.body["code"] == "file_in_use" and batch.id in e.value.message
    gone = client.files.delete(uploads[1].id)
    assert (gone.id, gone.object, gone.deleted) == (uploads[1].id, "file", True)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploads[1].id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(uploads[1].id)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id=uploads[1].id, endpoint=COMPLETIONS, completion_window="24h")
    assert uploads[1].id not in [f.id for f in client.files.list()]
    assert wait_final(client, client.batches.cancel(batch.id).id, 30).status == "cancelled"
    assert client.files.delete(uploads[0].id).deleted  # finalized: its input may go


def test_an_upload_without_content_length_is_411(bare):
    """A chunked upload is refused before anything is read (it would be spooled whole first)."""
    url, client = bare
    parts = urllib.parse.urlsplit(url)
    boundary = "b0undary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="c.jsonl"\r\n\r\n'
        '{"custom_id": "a", "body": {"prompt": "x"}}\n\r\n'
        f"--{boundary}--\r\n"
    ).encode()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        headers = {
            "Authorization": f"Bearer {KEY}",
            "Content-Type": f"multipart/form-data; boundary={boundary}",
        }
        conn.request("POST", parts.path + "/files", body=iter([body]), headers=headers, encode_chunked=True)
        resp = conn.getresponse()
        status, answer = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert status == 411 and set(answer["error"]) == {"message", "type", "param", "code"}
    assert "Content-Length" in answer["error"]["message"] and answer["error"]["param"] == "file"
    assert client.files.list().data == []


def test_only_ids_the_store_issues_are_files(bare):
    """``<id>.json`` is the name of a file's object, not a file: deleting it is 404 and the file
    stays (and stays guarded while a batch reads it)."""
    _, client = bare
    f = client.files.create(
        file=("g.jsonl", jsonl([{"custom_id": "a", "body": {"prompt": "x"}}])), purpose="batch"
    )
    assert re.fullmatch(r"file-[0-9a-f]{24}", f.id)
    batch = client.batches.create(input_file_id=f.id, endpoint=COMPLETIONS, completion_window="24h")
    for other in (f.id + ".json", "." + f.id, f.id.upper(), f.id + "0"):
        with pytest.raises(openai.NotFoundError):
            client.files.delete(other)
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(other)
    assert client.files.retrieve(f.id).filename == "g.jsonl"
    assert [x.id for x in client.files.list()] == [f.id]
    with pytest.raises(openai.ConflictError):
        client.files.delete(f.id)
    assert client.batches.retrieve(batch.id).input_file_id == f.id


def test_secrets_are_written_owner_only_from_creation(tmp_path):
    """The HTTP key file and the admin token: created 0o600 whatever the umask; a file that
    existed with a wider mode is narrowed."""
    old = os.umask(0)
    try:
        args = argparse.Namespace(http_port=0, http_api_key="k-123", files_dir=None)
        key_file = http_settings(args, tmp_path)
        assert key_file.read_text() == "k-123\n" and stat.S_IMODE(key_file.stat().st_mode) == 0o600
        wide = tmp_path / "admin-token"
        wide.write_text("an old, longer token\n")
        wide.chmod(0o644)
        write_private(wide, "t\n")
        assert wide.read_text() == "t\n" and stat.S_IMODE(wide.stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_fields_and_models_the_clusters_cannot_serve_are_refused_naming_them(bare, redis_url):
    """Rows passing OpenAI fields through (tools, logprobs) to clusters whose workers registered that they
    run prompts themselves (no field honoured), and rows naming a model no cluster serves, fail the batch
    with their lines; the same fields on clusters that honour them are accepted."""
    _, client = bare
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    names = sorted(r.smembers(keys.CLUSTERS))
    assert names
    for name in names:  # as a native engine's worker registers: a named model, no field passed through
        r.hset(
            keys.cluster_info(name),
            mapping={"backend": "native", "served_model": "tiny", "openai_fields": ""},
        )
    chat = [{"role": "user", "content": "x"}]
    rows = [
        {"custom_id": "ok", "body": {"model": "tiny", "messages": chat}},
        {"custom_id": "tools", "body": {"model": "tiny", "messages": chat, "tools": [], "logprobs": True}},
        {"custom_id": "model", "body": {"model": "gpt-x", "messages": chat}},
    ]
    f = client.files.create(file=("t.jsonl", jsonl(rows)), purpose="batch")
    failed = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    errors = {e.line: e.message for e in failed.errors.data}
    assert failed.status == "failed" and sorted(errors) == [2, 3], errors
    assert "logprobs, tools cannot be honoured by cluster" in errors[2] and "(native)" in errors[2]
    assert "model 'gpt-x' is served by no cluster (served: tiny)" in errors[3]
    for name in names:  # endpoints that pass every field through
        r.hset(
            keys.cluster_info(name), mapping={"backend": "endpoint", "openai_fields": ",".join(PASS_THROUGH)}
        )
    f = client.files.create(file=("t.jsonl", jsonl(rows[:2])), purpose="batch")
    accepted = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    assert accepted.status != "failed", accepted.errors
