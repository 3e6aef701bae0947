"""Who may see a batch, on the real gateway (gRPC and HTTP on loopback, real Redis): issue 31's
review of the front. A batch's owner is written in the transaction that creates it; an ownerless
batch (older code) is claimed by the first token client that resubmits it; the HTTP front is a
client of its own and answers only for its own batches; identities that no token proves
(``x-client-id``, an address) never share a token client's quota; ``admin`` is no token name; the
admin API's token is checked before its request is decoded.
"""

from __future__ import annotations

import json
import os
import threading

import grpc
import pytest
import redis
from openai import OpenAI

from gateway.batches.quota import client_key, client_of
from gateway.config import ClusterSpec, GatewayConfig
from gateway.grpc_api.auth import parse_tokens
from gateway.grpc_api.tls import channel
from gateway.http_api.format import COMPLETIONS
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, batch_of, wait_until
from tests.openai_http_helpers import KEY, http_gateway, jsonl, raw_call
from workqueue import QueuedQuery, WorkQueue, connect, keys

ALICE, BOB, ADMIN = "alice-token-0123456789", "bob-token-0123456789ab", "admin-token-0123456789"
TOKENS = {ALICE: "alice", BOB: "bob"}


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


@pytest.fixture
def front(redis_url, tmp_path):
    """A gateway with client tokens, an admin token, its HTTP front and a cap of 3 queued queries
    per client (no engine runs); yields (gRPC address, HTTP base URL, queue)."""
    g = http_gateway(
        redis_url, tmp_path / "files", client_tokens=TOKENS, admin_token=ADMIN, max_queued_per_client=3
    )
    address = g.start()
    try:
        yield address, g.config.http_url, WorkQueue(connect(redis_url))
    finally:
        g.stop()


def test_the_owner_is_written_in_the_transaction_that_creates_the_batch(redis_url, monkeypatch):
    """Not in a second write after it, which a deadline, a Redis error or a SIGKILL in between left
    undone: an ownerless batch any client could read and cancel. Redis's MONITOR shows the owner's
    write between the MULTI and the EXEC that create the batch, for a batch created in
    ``SubmitBatch`` and for one accepted for background intake."""
    monkeypatch.setenv("FLEETBATCH_INTAKE_SYNC_MAX", "4")  # 4 queries or more: background intake
    config = GatewayConfig(
        redis_url=redis_url, offload=False, clusters=[ClusterSpec("a")], client_tokens=TOKENS
    )
    g = GatewayThread(config)
    address = g.start()
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    seen: list[str] = []
    marker = "end-of-the-submissions"
    started = threading.Event()

    def watch() -> None:
        with r.monitor() as m:
            started.set()
            for command in m.listen():
                seen.append(command["command"])
                if marker in command["command"]:
                    return

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    try:
        assert started.wait(30)
        r.ping()
        with channel(address, token=ALICE) as ch:
            stub = pb_grpc.BatchServiceStub(ch)
            stub.SubmitBatch(batch_of(2, batch_id="small"), timeout=60)
            assert stub.SubmitBatch(batch_of(5, batch_id="large"), timeout=60).status == pb.VALIDATING
        r.echo(marker)
        reader.join(60)
        assert not reader.is_alive()
    finally:
        g.stop()
    for bid in ("small", "large"):
        key = "{fb}:b:" + bid
        status_write = next(i for i, c in enumerate(seen) if c.startswith(f"HSET {key} ") and " status " in c)
        begin = max(i for i in range(status_write) if seen[i] == "MULTI")
        end = min(i for i in range(status_write, len(seen)) if seen[i] == "EXEC")
        creation = seen[begin:end]
        assert any(key in c and " owner alice" in c for c in creation), seen[begin:]


def test_an_ownerless_batch_is_claimed_by_the_first_client_that_resubmits_it(front):
    """What a submission cut between its creation and its owner's write left (older code): the
    retry was answered without recording an owner, so the batch stayed open to every client."""
    address, _, queue = front
    queries = batch_of(2, batch_id="cut")
    queue.create_batch("cut", [(QueuedQuery("cut", q.id, q.prompt, 8, 4, 4.0), "a") for q in queries.queries])
    assert queue.r.hget(keys.batch("cut"), "owner") is None
    with channel(address, token=ALICE) as a_ch, channel(address, token=BOB) as b_ch:
        alice, bob = pb_grpc.BatchServiceStub(a_ch), pb_grpc.BatchServiceStub(b_ch)
        assert alice.SubmitBatch(queries, timeout=30).id == "cut"  # her retry: the batch is hers now
        calls = [
            lambda: bob.GetBatch(pb.GetBatchRequest(batch_id="cut"), timeout=30),
            lambda: bob.CancelBatch(pb.CancelBatchRequest(batch_id="cut"), timeout=30),
            lambda: list(bob.StreamResults(pb.StreamResultsRequest(batch_id="cut"), timeout=30)),
        ]
        assert [_code(c) for c in calls] == [grpc.StatusCode.NOT_FOUND] * 3
        assert _code(lambda: bob.SubmitBatch(queries, timeout=30)) == grpc.StatusCode.ALREADY_EXISTS
        assert alice.GetBatch(pb.GetBatchRequest(batch_id="cut"), timeout=30).status == pb.IN_PROGRESS


def test_two_clients_racing_on_one_batch_id_one_gets_it(front):
    """Same id, same queries, at once: one client's batch; the other is refused, whichever lost."""
    address, _, queue = front
    with channel(address, token=ALICE) as a_ch, channel(address, token=BOB) as b_ch:
        stubs = {"alice": pb_grpc.BatchServiceStub(a_ch), "bob": pb_grpc.BatchServiceStub(b_ch)}
        for k in range(3):  # the cap is 3 queued queries a client: one client may win every round
            bid = f"race{k}"
            futures = {
                n: s.SubmitBatch.future(batch_of(1, batch_id=bid), timeout=60) for n, s in stubs.items()
            }
            won = []
            for name, f in futures.items():
                try:
                    assert f.result().id == bid
                    won.append(name)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.ALREADY_EXISTS, e
            assert won == [queue.r.hget(keys.batch(bid), "owner")], won


def _http_batch(url: str, client_id: str = "") -> str:
    client = OpenAI(base_url=url, api_key=KEY, max_retries=0)
    rows = jsonl([{"custom_id": f"r{i}", "body": {"prompt": "hello"}} for i in range(3)])
    f = client.files.create(file=("in.jsonl", rows), purpose="batch")
    headers = {"x-client-id": client_id} if client_id else {}
    b = client.batches.create(
        input_file_id=f.id, endpoint=COMPLETIONS, completion_window="24h", extra_headers=headers
    )
    assert b.status != "failed", b
    return b.id


def test_the_http_front_answers_only_for_its_own_batches(front):
    """The HTTP key is one for all: it reads and cancels the front's batches, never a token
    client's (404, as for an unknown id); a token client does not see the front's batches."""
    address, url, queue = front
    with channel(address, token=ALICE) as ch:
        alice = pb_grpc.BatchServiceStub(ch)
        alice.SubmitBatch(batch_of(2, batch_id="alices"), timeout=30)
        http_id = _http_batch(url)
        assert _code(lambda: alice.GetBatch(pb.GetBatchRequest(batch_id=http_id), timeout=30)) == (
            grpc.StatusCode.NOT_FOUND
        )
    status, body = raw_call(f"{url}/batches/alices")
    assert status == 404, body
    status, body = raw_call(f"{url}/batches/alices/cancel", data=b"{}")
    assert status == 404, body
    assert queue.batch("alices").status == "in_progress"
    assert raw_call(f"{url}/batches/{http_id}")[0] == 200
    with channel(address, token=ADMIN) as ch:  # the admin sees every batch
        stub = pb_grpc.BatchServiceStub(ch)
        assert stub.GetBatch(pb.GetBatchRequest(batch_id=http_id), timeout=30).id == http_id


def test_a_header_never_counts_against_a_token_clients_quota(front):
    """``x-client-id: alice`` over HTTP is not the token client alice: her cap of 3 stays hers."""
    address, url, queue = front
    _http_batch(url, client_id="alice")  # 3 queries, all of the cap
    with channel(address, token=ALICE) as ch:
        assert pb_grpc.BatchServiceStub(ch).SubmitBatch(batch_of(3, batch_id="a1"), timeout=30).id == "a1"
    assert queue.r.smembers(client_key("alice")) == {"a1"}
    assert client_of({"x-client-id": "alice"}, "ipv4:127.0.0.1:5") == "hdr:alice"
    assert client_of({}, "ipv4:127.0.0.1:5") == "ip:127.0.0.1"


def test_a_token_named_admin_is_refused_naming_its_line():
    """Such an entry silently saw every batch: ``admin`` is the admin token's client."""
    with pytest.raises(ValueError) as e:
        parse_tokens(f"# clients\nalice:{ALICE}\nadmin:{BOB}\n", "tokens.txt")
    assert "tokens.txt line 3" in str(e.value) and "'admin'" in str(e.value)
    with pytest.raises(ValueError) as e:
        parse_tokens(f"alice:{ALICE},admin:{BOB}", "$FLEETBATCH_CLIENT_TOKENS")
    assert "line 1" in str(e.value) and "admin" in str(e.value)


def test_an_admin_call_without_the_admin_token_is_refused_before_it_is_decoded(redis_url):
    """Else a caller with no token could make the gateway decode large admin requests (and hold
    the in-flight byte budget that token clients need). Bytes that are no request at all show it:
    without the token they are UNAUTHENTICATED, not INVALID_ARGUMENT."""
    config = GatewayConfig(redis_url=redis_url, offload=False, clusters=[ClusterSpec("a")], admin_token=ADMIN)
    g = GatewayThread(config)
    address = g.start()
    try:
        with grpc.insecure_channel(address) as ch:
            garbage = ch.unary_unary(
                "/fleetbatch.v1.AdminService/GetClusterStatus",
                request_serializer=lambda b: b,
                response_deserializer=pb.ListClustersResponse.FromString,
            )
            for metadata in ((), (("authorization", "Bearer wrong-token-0123456789"),)):
                assert _code(lambda m=metadata: garbage(b"\xff\xff\xff", metadata=m, timeout=30)) == (
                    grpc.StatusCode.UNAUTHENTICATED
                )
            admin = (("authorization", f"Bearer {ADMIN}"),)
            assert _code(lambda: garbage(b"\xff\xff\xff", metadata=admin, timeout=30)) == (
                grpc.StatusCode.INVALID_ARGUMENT
            )
            stub = pb_grpc.AdminServiceStub(ch)
            assert stub.GetClusterStatus(pb.ListClustersRequest(), metadata=admin, timeout=30).clusters
    finally:
        g.stop()


def test_the_http_fronts_creations_count_in_the_in_flight_bytes(redis_url, tmp_path):
    """An HTTP batch creation holds its input in memory as a gRPC submission does: while one is in
    flight (held here reading its input file, a FIFO the test writes when it is done), a gRPC
    request past the budget (``--max-inflight-mb``) is RESOURCE_EXHAUSTED, as it would be past
    another gRPC request."""
    rows = jsonl([{"custom_id": f"r{i}", "body": {"prompt": "hello"}} for i in range(3)])
    g = http_gateway(redis_url, tmp_path / "files", max_inflight_bytes=len(rows))
    address = g.start()
    try:
        client = OpenAI(base_url=g.config.http_url, api_key=KEY, max_retries=0)
        f = client.files.create(file=("in.jsonl", rows), purpose="batch")
        fifo = tmp_path / "files" / f.id
        fifo.unlink()
        os.mkfifo(fifo)  # the creation waits in its read until the test writes the rows
        body = json.dumps({"input_file_id": f.id, "endpoint": COMPLETIONS, "completion_window": "24h"})
        created: list = []
        creating = threading.Thread(
            target=lambda: created.append(
                raw_call(f"{g.config.http_url}/batches", data=body.encode(), timeout=120)
            ),
            daemon=True,
        )
        creating.start()
        invalid = batch_of(1)
        invalid.queries[0].id = ""  # refused by validation, when it is decoded at all

        def refused() -> bool:
            with grpc.insecure_channel(address) as ch:
                code = _code(lambda: pb_grpc.BatchServiceStub(ch).SubmitBatch(invalid, timeout=30))
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), code
            return code == grpc.StatusCode.RESOURCE_EXHAUSTED

        def reading() -> int | None:  # the creation has opened its input (its bytes are counted)
            try:
                return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader yet
                return None

        fd = wait_until(reading, 60, "the HTTP creation to read its input file")
        try:
            wait_until(refused, 60, "a gRPC request to be refused while the HTTP creation is in flight")
        finally:
            # the creation reads its input twice (checked, then sent: it streams a large file), the second
            # time from the file the path now names
            fifo.unlink()
            fifo.write_bytes(rows)
            os.write(fd, rows)  # lets the creation go on
            os.close(fd)
        creating.join(120)
        assert created and created[0][0] == 200, created
        wait_until(lambda: not refused(), 60, "the creation's bytes to be given back")
    finally:
        g.stop()
