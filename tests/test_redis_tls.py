"""Engines in another cloud on the home Redis: TLS (``rediss://``, the CA from ``$FLEETBATCH_REDIS_CA``) and
an ACL user per role (:mod:`workqueue.acl`). One real TLS-only redis-server (Debian's, 7.0) for the module,
its users from ``fleetbatch gateway redis-acl``'s rules, certificates made here (``tests/tls_certs.py``);
a real engine process and the real gateway complete a batch through it; what fails says why."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import grpc
import pytest
import redis
from openai import OpenAI

from gateway.cli import main as gateway_main
from gateway.config import ClusterSpec, GatewayConfig
from gateway.http_api.format import CHAT
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import REPO, GatewayThread, batch_of, start_engine, wait_until
from tests.openai_http_helpers import ENGINE_ARGS, KEY, jsonl, wait_final
from workqueue import WorkQueue, connect
from workqueue.acl import ROLES, SCRIPT_COMMANDS, acl_line
from workqueue.redis_tls import CA_ENV, CERT_ENV, KEY_ENV

tls_certs = pytest.importorskip("tests.tls_certs")

pytestmark = pytest.mark.xdist_group("redis-tls")  # the module's one server and engine

REDIS = "/usr/bin/redis-server"
PASSWORDS = {"admin": "admin-pw", "engines-east": "east-pw", "gw": "gw-pw"}
ADMIN_COMMANDS = (
    ("FLUSHALL",),
    ("CONFIG", "GET", "maxmemory"),
    ("KEYS", "*"),
    ("SCAN", "0"),
    ("DEBUG", "SLEEP", "0"),
    ("ACL", "LIST"),
    ("SCRIPT", "FLUSH"),
    ("SHUTDOWN", "NOSAVE"),
    ("MONITOR",),
    ("GET", "not-the-queue"),  # a key outside {fb}:*
    ("EVAL", "return redis.call('get', KEYS[1])", "1", "not-the-queue"),  # ... also from a script
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(d: Path, cert: str, key: str, ca: str, *extra: str) -> tuple[subprocess.Popen, int]:
    """A TLS-only redis-server on loopback (127.0.0.1 and 127.0.0.2), its port."""
    port = free_port()
    args = [
        REDIS, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1 127.0.0.2",
        "--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", ca,
        "--save", "", "--appendonly", "no", "--dir", str(d), *extra,
    ]  # fmt: skip
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """The server (TLS, client certificates optional, the roles' ACL users), the CAs, its URLs by user.
    DEBUG is enabled in the server so that the ACL is what refuses it to a role."""
    if (
        not Path(REDIS).exists()
        or b"libssl" not in subprocess.run(["ldd", REDIS], capture_output=True).stdout
    ):
        pytest.skip("no TLS-capable /usr/bin/redis-server")
    d = tmp_path_factory.mktemp("redis-tls")
    ca, other = tls_certs.CA(d, "home-ca"), tls_certs.CA(d, "unrelated-ca")
    cert, key = ca.issue("redis")
    users = [f"user admin on >{PASSWORDS['admin']} ~* &* +@all", "user default off"]
    users += [
        acl_line("engines-east", "worker", PASSWORDS["engines-east"]),
        acl_line("gw", "gateway", "gw-pw"),
    ]
    (d / "users.acl").write_text("\n".join(users) + "\n")
    proc, port = start_redis(
        d,
        cert,
        key,
        ca.pem,
        "--tls-auth-clients",
        "optional",
        "--aclfile",
        str(d / "users.acl"),
        "--enable-debug-command",
        "yes",
    )
    env = pytest.MonkeyPatch()
    env.setenv(CA_ENV, ca.pem)
    url = {u: f"rediss://{u}:{pw}@localhost:{port}/0" for u, pw in PASSWORDS.items()}
    try:
        admin = wait_until(lambda: _try(url["admin"]), 30, "the TLS redis-server")
        yield {"url": url, "port": port, "ca": ca, "other": other, "dir": d, "admin": admin}
    finally:
        env.undo()
        proc.terminate()
        proc.wait(timeout=30)


def _try(url: str) -> redis.Redis | None:
    try:
        return connect(url)
    except ConnectionError:
        return None


def refused(url: str) -> str:
    with pytest.raises(ConnectionError) as e:
        connect(url)
    return str(e.value)


def test_a_worker_and_a_gateway_complete_a_batch_over_tls_as_their_acl_users(tls, tmp_path):
    """gRPC and the HTTP front (its files, finalizer, a file's deletion) as the gateway's user."""
    url, admin = tls["url"], tls["admin"]
    admin.acl_log_reset()
    engine = start_engine("east", url["engines-east"], tmp_path, *ENGINE_ARGS, "--lease-s", "5")
    config = GatewayConfig(
        redis_url=url["gw"], policy="token", clusters=[ClusterSpec("east", capacity_tps=100)]
    )
    config.http_port, config.http_api_key, config.files_dir = 0, KEY, str(tmp_path / "files")
    config.chat_template = "default"
    gateway = GatewayThread(config)
    address = gateway.start()
    try:
        queue = WorkQueue(connect(url["admin"]))
        wait_until(lambda: engine.poll() is not None or queue.clusters(["east"])[0].alive, 240, "the engine")
        assert engine.poll() is None, (tmp_path / "engine-east.log").read_text()
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.BatchServiceStub(ch)
            stub.SubmitBatch(batch_of(12, batch_id="tls"), timeout=60)
            rows = list(stub.StreamResults(pb.StreamResultsRequest(batch_id="tls", follow=True), timeout=120))
            final = stub.GetBatch(pb.GetBatchRequest(batch_id="tls"), timeout=30)
        assert final.status == pb.COMPLETED and final.request_counts.completed == 12
        counts = Counter(r.query_id for r in rows)
        assert sorted(counts) == sorted(f"q{i}" for i in range(12)) and set(counts.values()) == {1}
        assert {r.cluster for r in rows} == {"east"}

        client = OpenAI(base_url=config.http_url, api_key=KEY, max_retries=0)
        lines = [
            {"custom_id": f"c{i}", "method": "POST", "url": CHAT,
             "body": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": f"Rivers {i}?"}]}}
            for i in range(4)
        ]  # fmt: skip
        f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        done = wait_final(
            client, client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h").id
        )
        assert done.status == "completed" and done.request_counts.completed == 4
        out = [json.loads(x) for x in client.files.content(done.output_file_id).read().splitlines()]
        assert sorted(x["custom_id"] for x in out) == [f"c{i}" for i in range(4)]
        assert client.files.delete(f.id).deleted

        assert admin.acl_log() == []  # neither the worker nor the gateway was refused anything on the way
        assert {"engines-east", "gw"} <= {c["user"] for c in admin.client_list()}  # they ran as their users
    finally:
        gateway.stop()
        engine.terminate()
        engine.wait(timeout=30)


def test_the_worker_user_is_refused_admin_commands_and_other_keys(tls):
    tls["admin"].set("{fb}:sentinel", "still here")
    for user in ("engines-east", "gw"):
        r = connect(tls["url"][user])
        assert r.ping() and r.hset("{fb}:acl-probe", "by", user) in (0, 1)  # its own keys, its commands
        probe = r.register_script("return redis.call('hget', KEYS[1], 'by')")  # EVALSHA, loaded on NOSCRIPT
        assert probe(keys=["{fb}:acl-probe"]) == user  # its scripts, as the queue runs them
        if user == "gw":  # the gateway's own small scripts go by EVAL
            assert r.eval("return redis.call('hget', KEYS[1], 'by')", 1, "{fb}:acl-probe") == user
        else:  # a worker's password cannot run a script of its own making
            with pytest.raises(redis.exceptions.NoPermissionError, match="no permissions"):
                r.eval("return redis.call('hget', KEYS[1], 'by')", 1, "{fb}:acl-probe")
        for command in ADMIN_COMMANDS:
            with pytest.raises(redis.exceptions.NoPermissionError, match="no permissions"):
                r.execute_command(*command)
    assert tls["admin"].get("{fb}:sentinel") == "still here"  # the server is there, its data too


def test_a_wrong_ca_and_other_failures_are_named(tls, monkeypatch, tmp_path):
    url, port = tls["url"]["engines-east"], tls["port"]
    monkeypatch.setenv(CA_ENV, tls["other"].pem)
    message = refused(url)
    assert "TLS certificate verify failed (is $FLEETBATCH_REDIS_CA the CA that signed" in message
    assert (
        message.startswith("cannot reach Redis at rediss://engines-east:***@localhost:")
        and "east-pw" not in message
    )
    # a command says so and exits 1, without a traceback (the gateway's: the engine's imports torch first, 10 s;
    # its `fleetbatch engine serve` logs the same ConnectionError's text and exits 1 too)
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "calibrate", "--redis-url", url],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and "TLS certificate verify failed" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "east-pw" not in done.stderr

    monkeypatch.setenv(CA_ENV, str(tmp_path / "missing-ca.pem"))
    assert f"$FLEETBATCH_REDIS_CA names {tmp_path / 'missing-ca.pem'}, which is not a file" in refused(url)
    monkeypatch.setenv(CA_ENV, tls["ca"].pem)
    assert "does not name 127.0.0.2" in refused(f"rediss://engines-east:east-pw@127.0.0.2:{port}/0")
    assert "wrong user name or password (WRONGPASS)" in refused(
        f"rediss://engines-east:guess@localhost:{port}/0"
    )
    # mutual TLS: a client certificate of the home CA is taken, one of another CA refused
    cert, key = tls["ca"].issue("engines-east-client")
    monkeypatch.setenv(CERT_ENV, cert)
    monkeypatch.setenv(KEY_ENV, key)
    assert connect(url).ping()
    cert, key = tls["other"].issue("stranger")
    monkeypatch.setenv(CERT_ENV, cert)
    monkeypatch.setenv(KEY_ENV, key)
    assert re.search(r"(refused|does not trust|does it trust) the client certificate", refused(url))
    monkeypatch.delenv(KEY_ENV)
    assert "$FLEETBATCH_REDIS_CERT and $FLEETBATCH_REDIS_KEY go together" in refused(url)


def test_an_expired_server_certificate_is_named(tls, tmp_path):
    cert, key = tls["ca"].issue("expired", expired=True)
    proc, port = start_redis(tmp_path, cert, key, tls["ca"].pem, "--tls-auth-clients", "no")
    try:
        wait_until(
            lambda: "Connection refused" not in refused(f"rediss://localhost:{port}/0"), 30, "the server"
        )
        assert "the server's TLS certificate has expired" in refused(f"rediss://localhost:{port}/0")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_redis_acl_prints_rules_redis_takes_and_no_password(tls, tmp_path, capsys):
    secret = tmp_path / "password"
    secret.write_text("s3cret-pw\n")
    assert (
        gateway_main(
            ["redis-acl", "--user", "engines-west", "--role", "worker", "--password-file", str(secret)]
        )
        == 0
    )
    line = capsys.readouterr().out.strip()
    assert line == acl_line("engines-west", "worker", "s3cret-pw") and "s3cret-pw" not in line
    assert line.startswith(
        f"user engines-west reset on #{hashlib.sha256(b's3cret-pw').hexdigest()} resetchannels ~{{fb}}:* &{{fb}}:* -@all "
    )
    admin = tls["admin"]
    assert admin.execute_command("ACL", "SETUSER", *line.split()[1:])  # Redis takes the rules as they are
    west = connect(f"rediss://engines-west:s3cret-pw@localhost:{tls['port']}/0")
    assert west.ping()
    with pytest.raises(redis.exceptions.NoPermissionError):
        west.flushall()
    with pytest.raises(SystemExit):  # argparse: not a role
        gateway_main(["redis-acl", "--user", "x", "--role", "admin", "--password-file", str(secret)])
    assert (
        gateway_main(
            ["redis-acl", "--user", "x", "--role", "gateway", "--password-file", str(tmp_path / "no")]
        )
        == 1
    )
    assert "--password-file" in capsys.readouterr().err


def test_the_roles_allow_every_command_the_scripts_call():
    called = set()
    for package in ("workqueue", "gateway", "engines"):
        for path in (REPO / package).rglob("*.py"):
            called |= {c.lower() for c in re.findall(r"redis\.p?call\(\s*['\"](\w+)", path.read_text())}
    assert called and called <= set(SCRIPT_COMMANDS), sorted(called - set(SCRIPT_COMMANDS))
    for role in ROLES.values():
        assert set(SCRIPT_COMMANDS) <= set(role)
