"""TLS: the gateway's gRPC port and its Redis connection (``rediss://``), with certificates made in the test."""

from __future__ import annotations

import shutil
import subprocess
import time

import grpc
import pytest
import redis

from gateway.cli import main as gateway_main
from gateway.config import ClusterSpec, GatewayConfig
from gateway.grpc_api.tls import channel
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread
from workqueue import keys

REDIS = "/usr/bin/redis-server"


def _certs(d) -> dict[str, str]:
    """A throwaway CA and a server certificate for localhost / 127.0.0.1 (openssl)."""
    if not shutil.which("openssl"):
        pytest.skip("openssl not installed")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=fleetbatch-test-ca",
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    )
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "san.ext",
    )
    return {k: str(d / f) for k, f in (("ca", "ca.pem"), ("cert", "server.pem"), ("key", "server.key"))}


@pytest.fixture
def tls_redis(tmp_path):
    """A real redis-server serving TLS only, on a free loopback port."""
    if not shutil.which(REDIS) or b"libssl" not in subprocess.run(["ldd", REDIS], capture_output=True).stdout:
        pytest.skip("no TLS-capable /usr/bin/redis-server")
    certs = _certs(tmp_path)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            REDIS,
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            certs["cert"],
            "--tls-key-file",
            certs["key"],
            "--tls-ca-cert-file",
            certs["ca"],
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs['ca']}"
    deadline = time.monotonic() + 20
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)
    yield url, certs
    proc.terminate()
    proc.wait(timeout=10)


def test_grpc_and_redis_over_tls(tls_redis, capsys):
    url, certs = tls_redis
    g = GatewayThread(
        GatewayConfig(
            redis_url=url,
            policy="round_robin",
            offload=False,
            tls_cert=certs["cert"],
            tls_key=certs["key"],
            clusters=[ClusterSpec("a", capacity_tps=10)],
        )
    )
    address = g.start()
    try:
        with channel(address, certs["ca"]) as ch:
            stub = pb_grpc.BatchServiceStub(ch)
            req = pb.SubmitBatchRequest(batch_id="tls")
            req.queries.add(id="q0", prompt="Over TLS.", max_tokens=4)
            assert stub.SubmitBatch(req, timeout=30).request_counts.total == 1
        assert redis.Redis.from_url(url).exists(keys.batch("tls")) == 1  # it reached Redis over TLS
        with grpc.insecure_channel(address) as plain:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.BatchServiceStub(plain).GetBatch(pb.GetBatchRequest(batch_id="tls"), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert gateway_main(["status", "--target", address, "--tls-ca", certs["ca"], "--json"]) == 0
        assert '"name": "a"' in capsys.readouterr().out
    finally:
        g.stop()


def test_tls_needs_cert_and_key(redis_url):
    import asyncio

    from gateway.server import serve

    config = GatewayConfig(redis_url=redis_url, listen="127.0.0.1:0", tls_cert="/nonexistent.pem")
    with pytest.raises(ValueError, match="--tls-key"):
        asyncio.run(serve(config))
