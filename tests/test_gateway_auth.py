"""The batch API's client tokens and limits, on the real gateway over loopback gRPC (issue 31, finding 7).

A call without a known Bearer token is UNAUTHENTICATED; the client of the per-client cap is the
one its token names, whatever ``x-client-id`` it sends; calls past ``max_concurrent_rpcs`` are
RESOURCE_EXHAUSTED; the per-client locks do not outlive their submissions.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.batches.quota import ClientLocks
from gateway.config import ClusterSpec, GatewayConfig
from gateway.grpc_api.auth import Authenticator, load_tokens, parse_tokens
from gateway.grpc_api.tls import channel
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, wait_until

ALICE, BOB, ADMIN = "alice-token-0123456789", "bob-token-0123456789ab", "admin-token-0123456789"


def submission(n: int, batch_id: str = "") -> pb.SubmitBatchRequest:
    req = pb.SubmitBatchRequest(batch_id=batch_id)
    for i in range(n):
        req.queries.add(id=f"q{i}", prompt=f"prompt {i}", max_tokens=4)
    return req


@pytest.fixture
def gateway(redis_url):
    """A gateway with two client tokens and a cap of 3 queued queries per client; no engine runs."""
    config = GatewayConfig(
        redis_url=redis_url,
        offload=False,
        clusters=[ClusterSpec("a", capacity_tps=100)],
        client_tokens={ALICE: "alice", BOB: "bob"},
        admin_token=ADMIN,
        max_queued_per_client=3,
    )
    g = GatewayThread(config)
    address = g.start()
    yield address
    g.stop()


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_every_batch_call_needs_a_known_client_token(gateway):
    for token in ("", "not-a-token-of-anyone-here"):
        with channel(gateway, token=token) as ch:
            stub = pb_grpc.BatchServiceStub(ch)
            calls = [
                lambda s=stub: s.SubmitBatch(submission(1), timeout=30),
                lambda s=stub: s.GetBatch(pb.GetBatchRequest(batch_id="x"), timeout=30),
                lambda s=stub: s.CancelBatch(pb.CancelBatchRequest(batch_id="x"), timeout=30),
                lambda s=stub: list(s.StreamResults(pb.StreamResultsRequest(batch_id="x"), timeout=30)),
                lambda s=stub: s.ListClusters(pb.ListClustersRequest(), timeout=30),
            ]
            assert [_code(c) for c in calls] == [grpc.StatusCode.UNAUTHENTICATED] * len(calls)
            # health checks (the k8s probe) need no token
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    for token in (ALICE, ADMIN):  # the admin token is a client token too
        with channel(gateway, token=token) as ch:
            assert pb_grpc.BatchServiceStub(ch).ListClusters(pb.ListClustersRequest(), timeout=30).clusters


def test_the_client_is_the_one_its_token_names_not_its_header(gateway):
    forged = [("x-client-id", "bob")]
    with channel(gateway, token=ALICE) as alice, channel(gateway, token=BOB) as bob:
        a, b = pb_grpc.BatchServiceStub(alice), pb_grpc.BatchServiceStub(bob)
        a.SubmitBatch(submission(3, "alice-1"), metadata=forged, timeout=30)
        b.SubmitBatch(submission(3, "bob-1"), timeout=30)  # alice's queries are not bob's
        with pytest.raises(grpc.RpcError) as e:
            a.SubmitBatch(submission(1, "alice-2"), metadata=[("x-client-id", "mallory")], timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "'alice'" in e.value.details()


def _drain(stream, ended: list | None = None) -> None:
    """Read a stream to its end; the code it ended with goes to ``ended`` (else it must be CANCELLED)."""
    try:
        for _ in stream:
            pass
    except grpc.RpcError as e:
        if ended is None:
            assert e.code() == grpc.StatusCode.CANCELLED, e
        else:
            ended.append(e.code())


def test_calls_past_max_concurrent_rpcs_are_resource_exhausted(redis_url):
    """With a limit of 2, of 4 follow streams held open at once at least 2 are refused with
    RESOURCE_EXHAUSTED (gRPC counts the call slot it is waiting on too, so sometimes 3 are): never
    another code, and once the streams end, calls are served again."""
    config = GatewayConfig(
        redis_url=redis_url,
        offload=False,
        clusters=[ClusterSpec("a", capacity_tps=100)],
        max_concurrent_rpcs=2,
    )
    g = GatewayThread(config)
    address = g.start()
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.BatchServiceStub(ch)
            stub.SubmitBatch(submission(2, "pending"), timeout=30)  # no engine: it stays in progress
            follow = pb.StreamResultsRequest(batch_id="pending", follow=True)
            streams = [stub.StreamResults(follow, timeout=120) for _ in range(4)]
            ended: list[grpc.StatusCode] = []
            readers = [threading.Thread(target=_drain, args=(s, ended), daemon=True) for s in streams]
            for t in readers:  # a stream's call starts once it is read
                t.start()
            wait_until(lambda: len(ended) >= 2, 60, "streams past the limit to be refused")
            assert set(ended) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, ended
            for s in streams:
                s.cancel()
            for t in readers:
                t.join(timeout=60)
            assert set(ended) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}, ended

            def served() -> bool:
                try:
                    return stub.GetBatch(pb.GetBatchRequest(batch_id="pending"), timeout=30).id == "pending"
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    return False

            wait_until(served, 60, "calls to be served again once the streams end")
    finally:
        g.stop()


def test_client_locks_do_not_outlive_their_submissions():
    locks = ClientLocks()

    async def submit(client: str) -> weakref.ref:
        async with locks(client) as _:
            assert locks(client) is locks(client)  # one lock per client while it is in use
            return weakref.ref(locks(client))

    refs = [asyncio.run(submit(f"client-{i}")) for i in range(100)]
    gc.collect()
    assert all(r() is None for r in refs) and len(locks) == 0


def test_a_submission_waits_for_the_same_clients_lock():
    locks = ClientLocks()
    order: list[str] = []

    async def main() -> None:
        held = asyncio.Event()

        async def first() -> None:
            async with locks("c"):
                held.set()
                await asyncio.sleep(0)
                order.append("first")

        async def second() -> None:
            await held.wait()
            async with locks("c"):
                order.append("second")

        await asyncio.gather(first(), second())

    asyncio.run(main())
    assert order == ["first", "second"]


def test_token_tables_parse_and_refuse_bad_entries(tmp_path, monkeypatch):
    table = parse_tokens(f"# clients\nalice:{ALICE}\nbob: {BOB}  # the second\n", "f")
    assert table == {ALICE: "alice", BOB: "bob"}
    for bad in (f"alice {ALICE}", "alice:short", f"al ice:{ALICE}", f"a:{ALICE},b:{ALICE}"):
        with pytest.raises(ValueError):
            parse_tokens(bad, "f")
    monkeypatch.setenv("FLEETBATCH_CLIENT_TOKENS", f"alice:{ALICE},bob:{BOB}")
    assert load_tokens(None) == table
    (tmp_path / "tokens").write_text(f"carol:{ALICE}\n")
    assert load_tokens(str(tmp_path / "tokens")) == {ALICE: "carol"}
    with pytest.raises(FileNotFoundError):
        load_tokens(str(tmp_path / "missing"))
    auth = Authenticator(table, ADMIN)
    assert auth.client([("authorization", f"Bearer {BOB}")]) == "bob"
    assert auth.client([("authorization", f"Bearer {ADMIN}")]) == "admin"
    assert auth.client([("authorization", BOB)]) is None and auth.client([]) is None


def test_gateway_serve_refuses_to_start_without_tokens_unless_told(monkeypatch, capsys):
    from gateway.cli import main

    monkeypatch.delenv("FLEETBATCH_CLIENT_TOKENS", raising=False)
    assert main(["serve", "--redis-url", "redis://127.0.0.1:1/0"]) == 1
    assert "--no-auth" in capsys.readouterr().err


def test_the_fingerprint_of_a_submission_is_computed_off_the_event_loop(redis_url, monkeypatch):
    """Hashing every query of a large batch on the loop would stall every other call meanwhile."""
    from gateway.batches import service

    where: list[str] = []
    real = service.fingerprint

    def spy(request: pb.SubmitBatchRequest) -> str:
        try:
            asyncio.get_running_loop()
            where.append(f"event loop ({threading.current_thread().name})")
        except RuntimeError:
            where.append("worker thread")
        return real(request)

    monkeypatch.setattr(service, "fingerprint", spy)
    g = GatewayThread(GatewayConfig(redis_url=redis_url, offload=False, clusters=[ClusterSpec("a")]))
    address = g.start()
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.BatchServiceStub(ch)
            stub.SubmitBatch(submission(3, "fp"), timeout=30)
            stub.SubmitBatch(submission(3, "fp"), timeout=30)  # a retry compares fingerprints
    finally:
        g.stop()
    assert len(where) >= 2 and set(where) == {"worker thread"}, where


class _HeldSubmissions(pb_grpc.BatchServiceServicer):
    """A batch service whose submissions wait until the test lets them go (the limit is under test)."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.go = threading.Event()

    async def SubmitBatch(self, request, context):
        self.entered.release()
        await asyncio.to_thread(self.go.wait, 60)
        return pb.Batch(id=request.batch_id)


def test_requests_past_the_in_flight_bytes_are_resource_exhausted_until_one_ends():
    from gateway.batches.limits import InflightBytes
    from gateway.grpc_api.inflight import InflightBytesInterceptor

    budget = InflightBytes(len(submission(40).SerializeToString()) * 3 // 2)  # one such request fits
    service, loop, ready = _HeldSubmissions(), asyncio.new_event_loop(), threading.Event()
    box: dict = {}

    async def serve() -> None:
        server = grpc.aio.server(interceptors=[InflightBytesInterceptor(budget, pb.DESCRIPTOR.package)])
        pb_grpc.add_BatchServiceServicer_to_server(service, server)
        box["port"], box["stop"] = server.add_insecure_port("127.0.0.1:0"), asyncio.Event()
        await server.start()
        ready.set()
        await box["stop"].wait()
        await server.stop(None)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{box['port']}") as ch:
            stub = pb_grpc.BatchServiceStub(ch)
            first = stub.SubmitBatch.future(submission(40, "first"), timeout=60)
            assert service.entered.acquire(timeout=30)  # the first is decoded and being handled
            with pytest.raises(grpc.RpcError) as e:
                stub.SubmitBatch(submission(40, "second"), timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in e.value.details()
            service.go.set()
            assert first.result().id == "first"
            wait_until(lambda: budget.used == 0, 30, "the first request's bytes to be given back")
            assert stub.SubmitBatch(submission(40, "third"), timeout=30).id == "third"
            wait_until(lambda: budget.used == 0, 30, "the third request's bytes to be given back")
    finally:
        service.go.set()
        loop.call_soon_threadsafe(box["stop"].set)
        thread.join(30)
        assert not thread.is_alive()


def test_a_clients_batches_are_its_own(gateway):
    """Another client's calls on a batch are NOT_FOUND (its existence is not told); the admin sees all."""
    with channel(gateway, token=ALICE) as alice, channel(gateway, token=BOB) as bob:
        a, b = pb_grpc.BatchServiceStub(alice), pb_grpc.BatchServiceStub(bob)
        a.SubmitBatch(submission(2, "alices"), timeout=30)
        assert a.GetBatch(pb.GetBatchRequest(batch_id="alices"), timeout=30).request_counts.total == 2
        calls = [
            lambda: b.GetBatch(pb.GetBatchRequest(batch_id="alices"), timeout=30),
            lambda: b.CancelBatch(pb.CancelBatchRequest(batch_id="alices"), timeout=30),
            lambda: list(b.StreamResults(pb.StreamResultsRequest(batch_id="alices"), timeout=30)),
        ]
        assert [_code(c) for c in calls] == [grpc.StatusCode.NOT_FOUND] * len(calls)
        assert (
            _code(lambda: b.SubmitBatch(submission(2, "alices"), timeout=30))
            == grpc.StatusCode.ALREADY_EXISTS
        )
        assert a.SubmitBatch(submission(2, "alices"), timeout=30).id == "alices"  # her retry is fine
        assert a.GetBatch(pb.GetBatchRequest(batch_id="alices"), timeout=30).status == pb.IN_PROGRESS
    with channel(gateway, token=ADMIN) as admin:
        stub = pb_grpc.BatchServiceStub(admin)
        assert stub.CancelBatch(pb.CancelBatchRequest(batch_id="alices"), timeout=30).id == "alices"
