"""The k8s manifests as their processes see them: the plans and the cluster file load, the gateway serves
the ports its Service names, each client's Redis URL renders as the kubelet expands it (the gateways on
the plain in-cluster port, each cloud's engines on the TLS port as their ACL user), and the manifest's
Redis command, run for real on loopback with certificates and an ACL file made here, serves both: the
gateways' user on the plain port, a cloud's user over TLS (its CA checked, its name checked), anonymous
clients refused, a worker refused an admin command, its readiness probe passing without a password."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
import yaml

from gateway.config import load_clusters
from tests.k8s_checks import pod_of, render

K8S = Path(__file__).resolve().parent.parent / "k8s"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {t: render(K8S / t) for t in ("base", "engine", "overlays/aws-a100")}


def test_every_manifest_parses():
    for manifest in K8S.rglob("*.yaml"):
        docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
        assert docs, f"{manifest} is empty"


def test_overlay_plans_are_valid_plan_files():
    from planfile import load_plan

    for plan in sorted(K8S.glob("overlays/*/plan.json")):
        p = load_plan(plan)
        assert p.stages and p.predicted_throughput_tokens_per_s > 0


def test_cluster_config_loads():
    specs = load_clusters(K8S / "base" / "clusters.yaml")
    assert [s.name for s in specs] == ["aws-a100", "gcp-t4", "azure-v100"]
    overlays = {p.name for p in (K8S / "overlays").iterdir()}
    assert {s.name for s in specs} == overlays


def _workload(docs: list[dict], kind: str) -> dict:
    return next(d for d in docs if d["kind"] == kind)


def _container(docs: list[dict], kind: str = "Deployment") -> dict:
    return pod_of(_workload(docs, kind))["containers"][0]


def test_the_gateway_exposes_grpc_metrics_and_the_http_front(rendered):
    """Every port the gateway is told to serve is a container port and a port of its Service; its batch
    files are in object storage, which both replicas see."""
    docs = rendered["base"]
    container = _container(docs)
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "gateway")
    args = container["args"]
    served = {
        "grpc": int(args[args.index("--listen") + 1].rsplit(":", 1)[1]),
        "metrics": int(args[args.index("--metrics-port") + 1]),
        "http": int(args[args.index("--http-port") + 1]),
    }
    assert served == {"grpc": 50051, "metrics": 9100, "http": 8080}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == served
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == served
    assert args[args.index("--files") + 1].startswith("s3://")
    assert _workload(docs, "Deployment")["spec"]["replicas"] == 2
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]  # no disk of one replica
    exposed = next(x for x in (K8S / "Dockerfile").read_text().splitlines() if x.startswith("EXPOSE"))
    assert set(served.values()) <= {int(p) for p in exposed.split()[1:]}


def _k8s_env(container: dict, docs: list[dict], secrets: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet renders it: ``$(VAR)`` of earlier entries expanded,
    ConfigMap references read from ``docs``, Secret references from ``secrets`` (keyed ``secret/key``)."""
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for e in container["env"]:
        source = e.get("valueFrom", {})
        if "secretKeyRef" in source:
            env[e["name"]] = secrets[f"{source['secretKeyRef']['name']}/{source['secretKeyRef']['key']}"]
        elif "configMapKeyRef" in source:
            env[e["name"]] = maps[source["configMapKeyRef"]["name"]][source["configMapKeyRef"]["key"]]
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
    return env


HOME = {"fleetbatch-redis/user": "gateway", "fleetbatch-redis/password": "pw-home",
        "fleetbatch-admin/token": "a", "fleetbatch-http/api-key": "h"}  # fmt: skip
AWS = {"fleetbatch-redis/user": "aws-a100", "fleetbatch-redis/password": "pw-aws"}


def test_each_client_renders_its_redis_url(rendered):
    """The gateways and a home engine: the plain in-cluster port as the home user; a cloud's engines: TLS
    to the home Redis' address as the cloud's user, with the CA's file."""
    from cliutil.config_file import resolve_config
    from gateway.cli import build_parser
    from gateway.config import GatewayConfig

    gateway = _container(rendered["base"])
    args = resolve_config(build_parser().parse_args(gateway["args"]), {})
    config = GatewayConfig.from_args(args, redis_url="r", admin_token="t", clusters=[])
    assert (config.metrics_host, config.metrics_port) == ("0.0.0.0", 9100)
    assert not args.no_auth
    env = _k8s_env(gateway, rendered["base"], HOME)
    assert env["FLEETBATCH_REDIS_URL"] == "redis://gateway:pw-home@redis:6379/0"
    engine = _k8s_env(_container(rendered["engine"]), rendered["engine"], HOME)
    assert engine["FLEETBATCH_REDIS_URL"] == env["FLEETBATCH_REDIS_URL"]
    remote = _k8s_env(_container(rendered["overlays/aws-a100"]), rendered["overlays/aws-a100"], AWS)
    assert remote["FLEETBATCH_REDIS_URL"] == "rediss://aws-a100:pw-aws@redis.fleetbatch.example.com:6380/0"
    assert remote["FLEETBATCH_REDIS_CA"] == "/etc/fleetbatch/redis-ca/ca.crt"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _home_redis(tmp_path: Path, command: list[str], ports: dict[int, int]) -> subprocess.Popen:
    """The manifest's Redis command on loopback: its mounts under ``tmp_path``, its ports as ``ports`` maps them."""
    from workqueue.embedded import find_redis_server

    mounts = {
        "/etc/redis/tls": tmp_path / "tls",
        "/etc/redis/acl": tmp_path / "acl",
        "/data": tmp_path / "data",
    }
    line = []
    for word in command:
        for mount, here in mounts.items():
            word = str(here) + word[len(mount) :] if word == mount or word.startswith(mount + "/") else word
        line.append(str(ports.get(int(word), word)) if word.isdigit() else word)
    assert line[0] == "redis-server"
    return subprocess.Popen(
        [find_redis_server(), *line[1:], "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_the_home_redis_serves_the_gateways_in_clear_and_each_cloud_over_tls(tmp_path, rendered, monkeypatch):
    from tests.tls_certs import CA
    from workqueue.acl import acl_line
    from workqueue.embedded import connect

    for d in ("tls", "acl", "data"):
        (tmp_path / d).mkdir()
    ca = CA(tmp_path, "ca")
    cert, key = ca.issue("redis", hosts=("localhost",))  # the name the engines dial (REDIS_HOST)
    for name, path in (("tls.crt", cert), ("tls.key", key), ("ca.crt", ca.pem)):
        shutil.copy(path, tmp_path / "tls" / name)
    users = [
        "user default off",
        acl_line("gateway", "gateway", "pw-home"),
        acl_line("aws-a100", "worker", "pw-aws"),
    ]
    (tmp_path / "acl" / "users.acl").write_text("\n".join(users) + "\n")  # as the how-to writes it

    redis_container = _container(rendered["base"], "StatefulSet")
    plain, tls = _free_port(), _free_port()
    proc = _home_redis(tmp_path, redis_container["command"], {6379: plain, 6380: tls})
    try:
        home = _k8s_env(_container(rendered["base"]), rendered["base"], HOME)["FLEETBATCH_REDIS_URL"]
        home = home.replace("@redis:6379", f"@127.0.0.1:{plain}")
        deadline = time.monotonic() + 30
        while True:
            try:
                gateway = connect(home)
                break
            except ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    "the manifest's redis did not start"
                )
                time.sleep(0.1)
        assert gateway.set("{fb}:probe", "1")
        with pytest.raises(redis.exceptions.AuthenticationError):  # no anonymous client
            redis.Redis(host="127.0.0.1", port=plain).ping()

        overlay = rendered["overlays/aws-a100"]
        env = _k8s_env(_container(overlay), overlay, AWS)
        url = env["FLEETBATCH_REDIS_URL"].replace("redis.fleetbatch.example.com:6380", f"localhost:{tls}")
        monkeypatch.setenv("FLEETBATCH_REDIS_CA", str(tmp_path / "tls" / "ca.crt"))
        worker = connect(url)
        assert worker.get("{fb}:probe") == "1"
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.flushall()
        monkeypatch.setenv("FLEETBATCH_REDIS_CA", CA(tmp_path, "other").pem)
        with pytest.raises(ConnectionError, match="verify failed"):  # another CA: refused
            connect(url)

        assert "pw-" not in Path(f"/proc/{proc.pid}/cmdline").read_text()  # passwords only in the ACL file
        if shutil.which("redis-cli"):  # the readiness probe passes with no password
            probe = [
                c.replace("-p 6379", f"-p {plain}")
                for c in redis_container["readinessProbe"]["exec"]["command"]
            ]
            assert subprocess.run(probe, env={**os.environ, "REDISCLI_AUTH": ""}).returncode == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
