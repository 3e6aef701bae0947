"""Redis down or restarting: the gateway answers UNAVAILABLE (retryable), not UNKNOWN, and serves
again once Redis is back, without a restart."""

from __future__ import annotations

import grpc
import pytest

from gateway.config import ClusterSpec, GatewayConfig
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, wait_until
from workqueue.embedded import EmbeddedRedis


def _batch(n: int) -> pb.SubmitBatchRequest:
    req = pb.SubmitBatchRequest()
    for i in range(n):
        req.queries.add(id=f"q{i}", prompt=f"Explain topic number {i}.", max_tokens=8)
    return req


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_redis_down_is_unavailable_and_recovers(tmp_path):
    run_dir = tmp_path / "redis"
    server = EmbeddedRedis(run_dir, persist=True)
    config = GatewayConfig(
        redis_url=server.url,
        policy="round_robin",
        offload=False,
        clusters=[ClusterSpec("a", capacity_tps=100), ClusterSpec("b", capacity_tps=100)],
    )
    g = GatewayThread(config)
    channel = grpc.insecure_channel(g.start())
    stub = pb_grpc.BatchServiceStub(channel)
    try:
        first = stub.SubmitBatch(_batch(3))
        server.close()
        for call in (
            lambda: stub.GetBatch(pb.GetBatchRequest(batch_id=first.id)),
            lambda: stub.SubmitBatch(_batch(2)),
            lambda: stub.ListClusters(pb.ListClustersRequest()),
            lambda: list(stub.StreamResults(pb.StreamResultsRequest(batch_id=first.id))),
        ):
            code, details = _code(call)
            assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
            assert "Redis" in details
        server = EmbeddedRedis(run_dir, persist=True)  # back, with its data
        again = stub.GetBatch(pb.GetBatchRequest(batch_id=first.id))
        assert again.id == first.id and again.request_counts.total == 3
        assert stub.SubmitBatch(_batch(2)).request_counts.total == 2
    finally:
        channel.close()
        g.stop()
        server.close()


def test_redis_busy_running_a_script_is_unavailable_too(tmp_path):
    """Issue [4/7]: a Lua script past Redis' time limit makes Redis answer BUSY to everyone; the gateway
    said UNKNOWN. BUSY (and LOADING, MASTERDOWN, TRYAGAIN, ...) is a state that passes: UNAVAILABLE."""
    import threading
    import urllib.error
    import urllib.request

    import redis

    server = EmbeddedRedis(tmp_path / "redis", persist=False)
    config = GatewayConfig(
        redis_url=server.url, offload=False, clusters=[ClusterSpec("a", capacity_tps=100)], http_port=0,
        http_api_key="busy-test-key", files_dir=str(tmp_path / "files"),
    )  # fmt: skip
    g = GatewayThread(config)
    channel = grpc.insecure_channel(g.start())
    stub = pb_grpc.BatchServiceStub(channel)
    admin = redis.Redis(unix_socket_path=server.socket_file, decode_responses=True)
    admin.config_set("busy-reply-threshold", 50)  # ms (lua-time-limit): BUSY replies start sooner
    spin = redis.Redis(unix_socket_path=server.socket_file, socket_timeout=60)
    busy = threading.Thread(target=lambda: _swallow(spin.eval, "while true do end", 0), daemon=True)
    try:
        busy.start()
        wait_until(lambda: _is_busy(admin), 30, "Redis busy running the script")  # not before it: no race
        code, details = _code(lambda: stub.GetBatch(pb.GetBatchRequest(batch_id="any"), timeout=30))
        assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
        assert "BUSY" in details
        req = urllib.request.Request(
            config.http_url + "/batches/any", headers={"Authorization": "Bearer busy-test-key"}
        )
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(req, timeout=30)
        assert http.value.code == 503
    finally:
        _swallow(admin.script_kill)
        busy.join(timeout=30)
        channel.close()
        g.stop()
        server.close()


def _is_busy(client) -> bool:
    """Whether Redis answers BUSY (a script running past the threshold) instead of a PING's PONG."""
    import redis

    try:
        client.ping()
    except redis.exceptions.RedisError as e:
        return "BUSY" in str(e)
    return False


def _swallow(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # the script ends killed; a kill finds no script once it has
        pass
