"""Bad input against a real gateway on loopback and a real Redis: every finding of issue 14.

Size limits before tokenizing, a gRPC receive limit, invalid UTF-8 and corrupt bytes, ids
outside the key alphabet, the position limit shared with the engine, ``forced_length``,
admin input checked before anything is written, and removed clusters leaving the listing.
"""

from __future__ import annotations

import logging
import math
import time

import grpc
import pytest

from gateway.config import ClusterSpec, GatewayConfig
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, batch_of
from workqueue import WorkQueue, connect, keys

TOKEN = "badinput-admin-token"
MD = [("authorization", f"Bearer {TOKEN}")]


def _config(redis_url: str, **kw) -> GatewayConfig:
    base = dict(
        redis_url=redis_url,
        admin_token=TOKEN,
        policy="round_robin",
        max_prompt_tokens=64,
        offload=False,
        clusters=[ClusterSpec("a", capacity_tps=100), ClusterSpec("b", capacity_tps=100)],
    )
    base.update(kw)
    return GatewayConfig(**base)


@pytest.fixture
def start(redis_url):
    """Start a gateway with config overrides; yields (client, admin, queue, channel, address)."""
    running: list[tuple[GatewayThread, grpc.Channel]] = []

    def _start(**kw):
        g = GatewayThread(_config(redis_url, **kw))
        address = g.start()
        ch = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
        running.append((g, ch))
        return (
            pb_grpc.BatchServiceStub(ch),
            pb_grpc.AdminServiceStub(ch),
            WorkQueue(connect(redis_url)),
            ch,
            address,
        )

    yield _start
    for g, ch in running:
        ch.close()
        g.stop()


def rpc_error(call, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call(*args, **kw)
    return e.value


def nothing_enqueued(queue: WorkQueue) -> bool:
    return queue.r.keys(keys.query("*")) == [] and all(c.queue_length == 0 for c in queue.clusters())


# ---------------------------------------------------------------- sizes


def test_a_huge_prompt_is_rejected_by_bytes_before_tokenizing(start):
    client, _, queue, _, _ = start()
    req = batch_of(2)
    req.queries[1].prompt = "word " * 600_000  # 3 MB: seconds of tokenizing
    t0 = time.monotonic()
    err = rpc_error(client.SubmitBatch, req, timeout=30)
    elapsed = time.monotonic() - t0
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "query #1 ('q1'): prompt" in err.details() and "bytes" in err.details()
    assert "max_prompt_bytes" in err.details()
    assert elapsed < 1.5, f"rejecting a 3 MB prompt took {elapsed:.1f} s: it was tokenized first"
    assert nothing_enqueued(queue)


def test_a_message_over_the_receive_limit_is_resource_exhausted(start):
    client, *_ = start(max_request_bytes=1 << 20)
    req = batch_of(2000)
    for q in req.queries:
        q.metadata["pad"] = "x" * 600
    assert req.ByteSize() > 1 << 20
    err = rpc_error(client.SubmitBatch, req, timeout=30)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # a request under the limit still works on the same channel
    assert client.SubmitBatch(batch_of(2), timeout=30).request_counts.total == 2


def test_metadata_is_size_limited(start):
    client, _, queue, _, _ = start()
    req = batch_of(1)
    req.metadata["blob"] = "x" * 100_000
    assert "metadata" in rpc_error(client.SubmitBatch, req).details()
    req = batch_of(1)
    req.queries[0].metadata["blob"] = "x" * 100_000
    details = rpc_error(client.SubmitBatch, req).details()
    assert "query #0 ('q0'): metadata" in details
    assert nothing_enqueued(queue)


# ---------------------------------------------------------------- bytes on the wire


def _raw(ch: grpc.Channel, method: str):
    return ch.unary_unary(method, request_serializer=None, response_deserializer=None)


def test_invalid_utf8_and_corrupt_bytes_are_invalid_argument(start):
    client, _, queue, ch, _ = start()
    good = batch_of(1)
    good.queries[0].prompt = "PROMPTPROMPT"
    good.queries[0].id = "IDIDID"
    wire = good.SerializeToString()
    submit = _raw(ch, "/fleetbatch.v1.BatchService/SubmitBatch")
    for bad in (
        wire.replace(b"PROMPTPROMPT", b"\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8\xf7\xf6\xf5\xf4"),
        wire.replace(b"IDIDID", b"ID\xc3(ID"),
        b"\x0a\xff\xff\xff\xff",  # a length past the end
        b"\xff\xff\xff",
    ):
        err = rpc_error(submit, bad, timeout=10)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, err.code(), err.details())
        assert "SubmitBatchRequest" in err.details() and "UTF-8" in err.details()
    get = _raw(ch, "/fleetbatch.v1.BatchService/GetBatch")
    err = rpc_error(
        get, pb.GetBatchRequest(batch_id="AAAA").SerializeToString().replace(b"AAAA", b"\xff\xfe\xfd\xfc")
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert nothing_enqueued(queue)
    assert client.SubmitBatch(batch_of(1), timeout=10).request_counts.total == 1


def test_ids_outside_the_key_alphabet_are_invalid_argument(start):
    client, admin, queue, _, _ = start()
    client.SubmitBatch(batch_of(1, batch_id="x"))
    for bad in ("x:results", "x:done", "a b", "ü", "x" * 129, "x\n"):  # "x\n": a "$" anchor let it pass
        for call, req in (
            (client.GetBatch, pb.GetBatchRequest(batch_id=bad)),
            (client.CancelBatch, pb.CancelBatchRequest(batch_id=bad)),
        ):
            err = rpc_error(call, req)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, err.details())
            assert "batch_id" in err.details()
        err = rpc_error(lambda r: list(client.StreamResults(r)), pb.StreamResultsRequest(batch_id=bad))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    for call, req in (
        (admin.AddCluster, pb.AddClusterRequest(name="c:queue")),
        (admin.DrainCluster, pb.DrainClusterRequest(name="a:info")),
        (admin.RemoveCluster, pb.RemoveClusterRequest(name="a:info")),
        (admin.Rebalance, pb.RebalanceRequest(drain=["a:x"], dry_run=True)),
    ):
        err = rpc_error(call, req, metadata=MD)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (req, err.details())
        assert "name" in err.details() or "drain" in err.details()
    assert queue.cluster_names() == ["a", "b"]


def test_a_start_index_past_any_batch_is_invalid_argument_not_unknown(start):
    """Found by the fuzz test: a start_index near 2^63 overflowed Redis's range (its error came back
    UNKNOWN); negative ones were refused already."""
    client, _, _, _, _ = start()
    client.SubmitBatch(batch_of(1, batch_id="x"))
    for bad in (-1, 2**63 - 1, 2**53 + 1):
        err = rpc_error(
            lambda r: list(client.StreamResults(r)), pb.StreamResultsRequest(batch_id="x", start_index=bad)
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, err.details())
        assert "start_index" in err.details()
    assert list(client.StreamResults(pb.StreamResultsRequest(batch_id="x", start_index=2**53))) == []


# ---------------------------------------------------------------- positions and forced_length


def _prompt(tokens: int) -> str:
    """A prompt of exactly ``tokens`` tokens of the default tokenizer (without its start token)."""
    return "a" + " a" * (tokens - 1)


def test_the_gateway_and_the_engine_agree_on_the_position_limit(start):
    from localmodels import default_tokenizer

    tok = default_tokenizer()
    assert len(tok(_prompt(2047))["input_ids"]) == 2048  # the start token counts
    client, _, queue, _, _ = start(max_prompt_tokens=100_000)
    for n in (2048, 2047):  # 2048 + 1 and exactly the model's 2048 positions: the engine refuses both
        req = batch_of(1)
        req.queries[0].prompt = _prompt(n)
        err = rpc_error(client.SubmitBatch, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"prompt has {n + 1} tokens" in err.details() and "2048 positions" in err.details()
    assert nothing_enqueued(queue)
    req = batch_of(1)
    req.queries[0].prompt = _prompt(2046)
    req.queries[0].max_tokens = 1
    assert client.SubmitBatch(req).request_counts.total == 1


def test_forced_length_does_not_override_max_tokens_or_positions(start):
    client, _, queue, _, _ = start(max_prompt_tokens=100_000)
    req = batch_of(1)
    req.queries[0].max_tokens = 8
    req.queries[0].forced_length = 100
    details = rpc_error(client.SubmitBatch, req).details()
    assert "forced_length 100" in details and "max_tokens 8" in details
    req = batch_of(1)
    req.queries[0].prompt = _prompt(2000)
    req.queries[0].max_tokens = 4000
    req.queries[0].forced_length = 100
    details = rpc_error(client.SubmitBatch, req).details()
    assert "forced_length" in details and "2048 positions" in details
    assert nothing_enqueued(queue)
    req = batch_of(1)  # unset max_tokens takes forced_length: a benchmark's usual query
    req.queries[0].max_tokens = 0
    req.queries[0].forced_length = 300
    assert client.SubmitBatch(req).request_counts.total == 1


# ---------------------------------------------------------------- admin input


@pytest.mark.parametrize(
    "field,value",
    [
        ("capacity_tokens_per_s", -5.0),
        ("capacity_tokens_per_s", math.nan),
        ("capacity_tokens_per_s", math.inf),
        ("capacity_tokens_per_s", -math.inf),
        ("max_query_tokens", -1),
        ("kv_budget_tokens", -7),
    ],
)
def test_bad_admin_input_is_invalid_argument_and_writes_nothing(start, field, value):
    client, admin, queue, _, _ = start()
    err = rpc_error(admin.AddCluster, pb.AddClusterRequest(name="bad", **{field: value}), metadata=MD)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.details()
    assert "bad" not in queue.cluster_names()
    assert queue.r.exists(keys.cluster_info("bad")) == 0
    # the deployment still works
    assert [c.name for c in client.ListClusters(pb.ListClustersRequest()).clusters] == ["a", "b"]
    assert client.SubmitBatch(batch_of(2)).request_counts.total == 2


def test_bad_values_already_in_redis_do_not_brick_the_gateway(start, redis_url):
    """What an older gateway wrote for `--add bad --capacity -5` (or NaN) is read as 0, with a warning."""
    queue = WorkQueue(connect(redis_url))
    queue.r.sadd(keys.CLUSTERS, "neg", "nan")
    queue.r.hset(keys.cluster_info("neg"), mapping={"state": "active", "capacity_hint_tps": "-5"})
    queue.r.hset(keys.cluster_info("nan"), mapping={"state": "active", "capacity_hint_tps": "nan"})
    client, admin, *_ = start()
    names = [c.name for c in client.ListClusters(pb.ListClustersRequest()).clusters]
    assert names == ["a", "b", "nan", "neg"]
    assert client.SubmitBatch(batch_of(4)).request_counts.total == 4
    admin.RemoveCluster(pb.RemoveClusterRequest(name="neg", force=True), metadata=MD)
    assert admin.GetClusterStatus(pb.ListClustersRequest(), metadata=MD).clusters


def test_adding_an_existing_cluster_needs_update(start):
    _, admin, queue, _, _ = start()
    err = rpc_error(admin.AddCluster, pb.AddClusterRequest(name="a", capacity_tokens_per_s=5), metadata=MD)
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "update" in err.details()
    assert queue.clusters(["a"])[0].capacity_hint_tps == 100
    updated = admin.AddCluster(
        pb.AddClusterRequest(name="a", capacity_tokens_per_s=5, update=True), metadata=MD
    )
    assert updated.name == "a" and queue.clusters(["a"])[0].capacity_hint_tps == 5
    err = rpc_error(admin.AddCluster, pb.AddClusterRequest(name="zz", update=True), metadata=MD)
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_rebalance_cli_add_is_a_dry_run_by_default(start, capsys):
    from gateway.cli import main

    _, _, queue, _, address = start()
    argv = ["rebalance", "--target", address, "--token", TOKEN, "--add", "c", "--capacity", "40"]
    assert main(argv) == 0
    assert "dry run" in capsys.readouterr().out
    assert "c" not in queue.cluster_names()
    assert main([*argv, "--apply"]) == 0
    assert queue.clusters(["c"])[0].capacity_hint_tps == 40
    assert main([*argv, "--apply", "--capacity", "50"]) == 1
    assert "ALREADY_EXISTS" in capsys.readouterr().err
    assert main([*argv, "--apply", "--update", "--capacity", "50"]) == 0
    assert queue.clusters(["c"])[0].capacity_hint_tps == 50
    assert main(["rebalance", "--target", address, "--token", TOKEN, "--add", "d", "--capacity", "nan"]) == 1
    assert main(["rebalance", "--target", address, "--token", TOKEN, "--add", "d:queue", "--apply"]) == 1
    assert "d:queue" not in queue.cluster_names()


def test_removed_clusters_leave_the_listing(start):
    client, admin, queue, _, _ = start()
    admin.AddCluster(pb.AddClusterRequest(name="c", capacity_tokens_per_s=50), metadata=MD)
    client.SubmitBatch(batch_of(6))
    removed = admin.RemoveCluster(pb.RemoveClusterRequest(name="c"), metadata=MD)
    assert sum(m.moved for m in removed.moves) == 2
    assert [x.name for x in client.ListClusters(pb.ListClustersRequest()).clusters] == ["a", "b"]
    status = admin.GetClusterStatus(pb.ListClustersRequest(), metadata=MD)
    assert [x.name for x in status.clusters] == ["a", "b"]
    assert sum(x.queue_length for x in queue.clusters(["a", "b"])) == 6
    err = rpc_error(admin.RemoveCluster, pb.RemoveClusterRequest(name="c"), metadata=MD)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = rpc_error(admin.DrainCluster, pb.DrainClusterRequest(name="c"), metadata=MD)
    assert err.code() == grpc.StatusCode.NOT_FOUND  # draining must not bring it back
    assert queue.clusters(["c"])[0].state == "removed"
    # a removed name can be added again
    again = admin.AddCluster(pb.AddClusterRequest(name="c", capacity_tokens_per_s=10), metadata=MD)
    assert again.state == "active"
    assert [x.name for x in client.ListClusters(pb.ListClustersRequest()).clusters] == ["a", "b", "c"]


# ---------------------------------------------------------------- secrets


def test_the_admin_token_is_compared_in_constant_time(start, monkeypatch):
    import gateway.grpc_api.auth  # the one check of the admin token (gateway.grpc_api.auth.admin_refusal)

    calls = []
    real = gateway.grpc_api.auth.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(gateway.grpc_api.auth.hmac, "compare_digest", spy)
    _, admin, _, _, _ = start()
    err = rpc_error(
        admin.GetClusterStatus, pb.ListClustersRequest(), metadata=[("authorization", "Bearer no")]
    )
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert admin.GetClusterStatus(pb.ListClustersRequest(), metadata=MD).clusters
    assert len(calls) >= 2


def test_no_secrets_in_logs(redis_url, redis_server, caplog):
    import redis

    r = redis.Redis.from_url(redis_server.url)
    r.config_set("requirepass", "s3cret-pass")
    try:
        scheme, rest = redis_url.split("://", 1)
        url = f"{scheme}://:s3cret-pass@{rest}"
        caplog.set_level(logging.DEBUG)
        g = GatewayThread(_config(url))
        address = g.start()
        try:
            with grpc.insecure_channel(address) as ch:
                admin = pb_grpc.AdminServiceStub(ch)
                admin.GetClusterStatus(pb.ListClustersRequest(), metadata=MD)
                with pytest.raises(grpc.RpcError):
                    admin.GetClusterStatus(
                        pb.ListClustersRequest(), metadata=[("authorization", "Bearer wrong-secret")]
                    )
        finally:
            g.stop()
    finally:
        redis.Redis.from_url(url).config_set("requirepass", "")
    assert "gateway listening" in caplog.text
    for secret in ("s3cret-pass", TOKEN, "wrong-secret"):
        assert secret not in caplog.text
