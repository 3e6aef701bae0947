"""Input files the HTTP front cannot run, and a batch created while the front stops (real Redis,
real HTTP and gRPC servers on loopback).

An invalid input file makes a batch that is ``failed`` at once, as OpenAI's are, with ``errors``
naming each bad line, and nothing enqueued; numbers past protobuf's range are such errors (they
were a 500), and the gRPC road applies the same range rule. A create still running when the
front stops finishes and keeps its record.
"""

from __future__ import annotations

import json
import threading

import grpc
import openai
import pytest
from openai import OpenAI

from gateway.http_api import batches as ob
from gateway.http_api.format import CHAT, COMPLETIONS
from load.workload import from_openai_jsonl
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.openai_http_helpers import KEY, http_gateway, jsonl, raw_call
from workqueue import WorkQueue, connect, keys


@pytest.fixture
def front(redis_url, tmp_path):
    """A gateway with its HTTP front on cluster ``idle`` (no engine), prompts of at most 16 tokens;
    (client, queue, gRPC address)."""
    gateway = http_gateway(redis_url, tmp_path / "files", cluster="idle", max_prompt_tokens=16)
    address = gateway.start()
    try:
        client = OpenAI(base_url=gateway.config.http_url, api_key=KEY, max_retries=0)
        yield client, WorkQueue(connect(redis_url)), address
    finally:
        gateway.stop()


def _create(client: OpenAI, rows: list[dict] | bytes, endpoint: str = COMPLETIONS):
    data = rows if isinstance(rows, bytes) else jsonl(rows)
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    return f, client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")


def _nothing_enqueued(queue: WorkQueue, batch_id: str) -> None:
    assert queue.batch(batch_id) is None
    assert queue.queued_ids("idle") == []
    assert not queue.r.exists(keys.results(batch_id))


def test_numbers_past_protobufs_range_fail_the_batch_naming_line_and_field(front):
    """max_tokens 2^40 was ``500 internal error: ValueError``."""
    client, queue, _ = front
    rows = [
        {"custom_id": "a", "body": {"prompt": "hi", "max_tokens": 2**40}},
        {"custom_id": "b", "body": {"prompt": "hi", "seed": 2**64}},
        {"custom_id": "c", "body": {"prompt": "hi", "temperature": 10**400}},  # float() overflows
        {"custom_id": "d", "body": {"prompt": "hi", "max_tokens": 8, "seed": 2**63 - 1}},  # fine
        {"custom_id": "e", "body": {"prompt": "hi", "max_completion_tokens": 1e300}},
        {"custom_id": "f", "body": {"prompt": "hi", "seed": -1}},
    ]
    _, batch = _create(client, rows)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    errors = {e.line: e.message for e in batch.errors.data}
    assert sorted(errors) == [1, 2, 3, 5, 6]
    assert "max_tokens 1099511627776 outside [0, 2147483647]" in errors[1]
    assert "seed" in errors[2] and "seed" in errors[6] and "temperature" in errors[3]
    assert "max_completion_tokens" in errors[5]
    assert batch.request_counts.total == 0
    _nothing_enqueued(queue, batch.id)
    assert client.batches.retrieve(batch.id).status == "failed"


def test_the_grpc_road_uses_the_same_range_rule(front, tmp_path):
    """``fleetbatch loadgen submit --jsonl`` names the line before building its message; a gRPC message out
    of range is INVALID_ARGUMENT with the same words as the HTTP front's."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([{"custom_id": "a", "body": {"prompt": "hi"}},
                            {"custom_id": "b", "body": {"prompt": "hi", "max_tokens": 2**40}}]))  # fmt: skip
    with pytest.raises(ValueError, match=r"in.jsonl:2: max_tokens 1099511627776 outside \[0, 2147483647\]"):
        from_openai_jsonl(path)
    _, _, address = front
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.BatchServiceStub(ch)
        for field, value, words in (
            ("seed", -1, "seed -1 outside [0, 9223372036854775807]"),
            ("temperature", 11.0, "temperature 11.0 outside [0.0, 10.0]"),
            ("top_p", float("inf"), "top_p must be a finite number"),
        ):
            q = pb.Query(id="q", prompt="hello")
            setattr(q.sampling, field, value)
            with pytest.raises(grpc.RpcError) as e:
                stub.SubmitBatch(pb.SubmitBatchRequest(queries=[q]), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()


def test_an_invalid_input_file_makes_a_failed_batch_with_its_lines(front):
    """As OpenAI's: created, then ``failed`` with ``errors`` naming each line (the front's parse,
    the gateway's checks with and without tokenizing), nothing enqueued; listed; not cancellable;
    its input file may be deleted."""
    client, queue, _ = front
    raw = b"\n".join(
        [
            json.dumps({"custom_id": "a", "body": {"prompt": "fine"}}).encode(),
            b'{"custom_id": "b",',
            json.dumps({"custom_id": "a", "body": {"prompt": "again"}}).encode(),
            json.dumps({"custom_id": "c", "body": {"prompt": "   "}}).encode(),
            json.dumps({"custom_id": "d", "body": {"prompt": "word " * 40}}).encode(),
            json.dumps({"custom_id": "e", "body": {"prompt": "x", "functions": []}}).encode(),
            json.dumps(
                {
                    "custom_id": "f",
                    "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
                }
            ).encode(),  # fmt: skip
        ]
    )
    f, batch = _create(client, raw, CHAT)
    assert batch.status == "failed", batch
    errors = {e.line: e for e in batch.errors.data}
    assert sorted(errors) == [2, 3, 4, 6, 7]
    assert errors[2].code == "invalid_json_line" and errors[3].code == "duplicate_custom_id"
    assert "empty prompt" in errors[4].message and "functions" in errors[6].message
    _nothing_enqueued(queue, batch.id)
    assert [b.id for b in client.batches.list()] == [batch.id]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)

    # the tokenized checks (SubmitBatch's own) name their line too
    rows = [
        {"custom_id": "ok", "body": {"prompt": "fine"}},
        {"custom_id": "long", "body": {"prompt": "word " * 40}},
    ]
    _, long = _create(client, rows)
    assert long.status == "failed" and [e.line for e in long.errors.data] == [2]
    assert "tokens" in long.errors.data[0].message
    _nothing_enqueued(queue, long.id)

    _, empty = _create(client, b"\n\n")
    assert empty.status == "failed" and empty.errors.data[0].code == "empty_file"
    assert client.files.delete(f.id).deleted  # not the input of a batch still running


def test_a_malformed_request_is_still_a_4xx(front):
    client, queue, _ = front
    f = client.files.create(
        file=("g.jsonl", jsonl([{"custom_id": "a", "body": {"prompt": "x"}}])), purpose="batch"
    )
    url = str(client.base_url).rstrip("/")
    for body, param in (
        ({"endpoint": CHAT, "completion_window": "24h"}, "input_file_id"),
        ({"input_file_id": f.id, "endpoint": "/v1/embeddings", "completion_window": "24h"}, "endpoint"),
        ({"input_file_id": f.id, "endpoint": CHAT, "completion_window": "1 hour"}, "completion_window"),
        ({"input_file_id": f.id, "endpoint": CHAT, "completion_window": "60d"}, "completion_window"),
        ({"input_file_id": f.id, "endpoint": CHAT, "completion_window": 24}, "completion_window"),
        (
            {"input_file_id": f.id, "endpoint": CHAT, "completion_window": "24h", "priority": "high"},
            "priority",
        ),
        ({"input_file_id": f.id, "endpoint": CHAT, "completion_window": "24h", "priority": 101}, "priority"),
        (
            {
                "input_file_id": f.id,
                "endpoint": CHAT,
                "completion_window": "24h",
                "metadata": {"k": "\ud800"},
            },
            "metadata",
        ),  # fmt: skip
    ):
        status, answer = raw_call(url + "/batches", data=json.dumps(body).encode())
        assert status == 400 and answer["error"]["param"] == param, answer
    status, _ = raw_call(url + "/batches", data=json.dumps({"input_file_id": "file-" + "0" * 24, "endpoint": CHAT, "completion_window": "24h"}).encode())  # fmt: skip
    assert status == 404
    assert client.batches.list().data == []


def test_a_batch_created_while_the_front_stops_keeps_its_record(redis_url, tmp_path, monkeypatch):
    """The create is inside SubmitBatch (held in ``create_batch``, in its worker thread) when the
    gateway is told to stop. It used to be cut (uvicorn cancels requests after its graceful
    timeout): the record was dropped while the thread went on to create the gateway batch, which
    then ran with no record, never finalized. Now the stop waits for it: the client gets the
    batch, whose record is pending."""
    entered, release = threading.Event(), threading.Event()
    create_batch = WorkQueue.create_batch

    def held(self, *args, **kw):
        entered.set()
        assert release.wait(120)
        return create_batch(self, *args, **kw)

    gateway = http_gateway(redis_url, tmp_path / "files", cluster="idle")
    gateway.start()
    url = gateway.config.http_url
    client = OpenAI(base_url=url, api_key=KEY, max_retries=0)
    f = client.files.create(
        file=("s.jsonl", jsonl([{"custom_id": "a", "body": {"prompt": "hi"}}])), purpose="batch"
    )
    monkeypatch.setattr(WorkQueue, "create_batch", held)
    answer: list = []

    def create() -> None:
        body = {"input_file_id": f.id, "endpoint": COMPLETIONS, "completion_window": "24h"}
        try:
            answer.append(raw_call(url + "/batches", data=json.dumps(body).encode(), timeout=120))
        except Exception as e:  # the connection cut
            answer.append(e)

    creator = threading.Thread(target=create)
    creator.start()
    assert entered.wait(60)
    stopper = threading.Thread(target=gateway.stop)
    stopper.start()
    creator.join(8)  # the old front cut the request after 5 s; the new one lets it finish
    release.set()
    creator.join(60)
    stopper.join(60)
    assert not stopper.is_alive()
    queue = WorkQueue(connect(redis_url))
    head = len(keys.batch(""))
    made = [k[head:] for k in queue.r.scan_iter(keys.batch("batch_*")) if ":" not in k[head:]]
    assert len(made) == 1  # the gateway batch was created
    assert queue.r.exists(ob.record_key(made[0])) and queue.r.sismember(ob.PENDING, made[0])
    status, body = answer[0]
    assert status == 200 and body["id"] == made[0] and body["status"] == "in_progress"


def test_odd_list_limits_are_400(front):
    """``limit=²`` (``str.isdigit`` but not ``int``) and a 5,000-digit limit were 500s."""
    client, _, _ = front
    url = str(client.base_url).rstrip("/")
    for path in ("/files", "/batches"):
        for limit in ("%C2%B2", "9" * 5000, "%D9%A3", "0"):
            status, body = raw_call(f"{url}{path}?limit={limit}")
            assert status == 400 and body["error"]["param"] == "limit", (path, limit[:10], body)


def test_deep_or_huge_json_is_a_4xx_or_a_failed_line(front):
    """JSON nested too deep raised RecursionError (no ValueError): a 500 for a request body and for
    a line; a request body is read up to 1 MiB, not whole whatever its size."""
    client, queue, _ = front
    url = str(client.base_url).rstrip("/")
    deep = b"[" * 100_000 + b"]" * 100_000
    status, body = raw_call(url + "/batches", data=deep)
    assert status == 400, body
    status, body = raw_call(url + "/batches", data=b" " * (2 << 20) + b"{}")
    assert status == 413, body
    _, batch = _create(client, jsonl([{"custom_id": "a", "body": {"prompt": "hi"}}]) + deep + b"\n")
    assert batch.status == "failed" and [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_json_line")
    ]
    _nothing_enqueued(queue, batch.id)


def test_accepted_connections_send_without_nagle_delay():
    """The front's socket says TCP, so asyncio sets TCP_NODELAY on each connection it accepts:
    with protocol 0 it did not, and every response on a kept-alive connection waited for the
    client's delayed ACK (about 40 ms: found by the fuzz test, 25 cases a second)."""
    import asyncio
    import socket

    from gateway.http_api.server import _bind

    async def main() -> int:
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        async def accepted(reader, writer) -> None:
            got.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=_bind("127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(got, 30)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(main()) != 0
