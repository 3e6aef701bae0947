"""The Kubernetes manifests parse, every kustomization reference exists, and clusters.yaml is valid."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from gateway.config import load_clusters

K8S = Path(__file__).resolve().parent.parent / "k8s"


def test_manifests_parse_and_references_exist():
    kustomizations = sorted(K8S.rglob("kustomization.yaml"))
    assert len(kustomizations) >= 5
    for k in kustomizations:
        spec = yaml.safe_load(k.read_text())
        for ref in spec.get("resources", []):
            assert (k.parent / ref).exists(), f"{k}: missing resource {ref}"
        for patch in spec.get("patches", []):
            assert (k.parent / patch["path"]).exists(), f"{k}: missing patch {patch['path']}"
        for gen in spec.get("configMapGenerator", []):
            for f in gen["files"]:
                assert (k.parent / f.split("=")[-1]).exists(), f"{k}: missing file {f}"
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


def test_the_gateway_exposes_grpc_metrics_and_the_http_front():
    """Every port the gateway is told to serve is a container port and a port of its Service."""
    docs = [d for d in yaml.safe_load_all((K8S / "base" / "gateway.yaml").read_text()) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    service = next(d for d in docs if d["kind"] == "Service")
    assert next(d for d in docs if d["kind"] == "PersistentVolumeClaim")["metadata"]["name"] == "openai-files"
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    served = {
        "grpc": int(args[args.index("--listen") + 1].rsplit(":", 1)[1]),
        "metrics": int(args[args.index("--metrics-port") + 1]),
        "http": int(args[args.index("--http-port") + 1]),
    }
    assert served == {"grpc": 50051, "metrics": 9100, "http": 8080}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == served
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == served
    env = {e["name"]: e for e in container["env"]}
    assert env["FLEETBATCH_HTTP_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "fleetbatch-http"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert args[args.index("--files") + 1] in mounts
    exposed = next(x for x in (K8S / "Dockerfile").read_text().splitlines() if x.startswith("EXPOSE"))
    assert set(served.values()) <= {int(p) for p in exposed.split()[1:]}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _container(path: Path) -> dict:
    workload = next(d for d in _docs(path) if d["kind"] in ("Deployment", "StatefulSet"))
    return workload["spec"]["template"]["spec"]["containers"][0]


def _k8s_env(container: dict, values: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet renders it: ``$(VAR)`` of earlier entries expanded,
    Secret references replaced by ``values`` (keyed ``secret/key``)."""
    env: dict[str, str] = {}
    for e in container["env"]:
        if "valueFrom" in e:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = values[f"{ref['name']}/{ref['key']}"]
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
    return env


def test_the_gateway_manifest_renders_to_an_authenticated_gateway_with_reachable_metrics(tmp_path):
    """Finding 7 and 10: the gRPC API needs client tokens from a Secret, metrics bind every address
    (the scrape of :9100 comes from outside the pod), and Redis' URL carries a password from a Secret."""
    from cliutil.config_file import resolve_config
    from gateway.cli import build_parser
    from gateway.config import GatewayConfig

    path = K8S / "base" / "gateway.yaml"
    container = _container(path)
    args = resolve_config(build_parser().parse_args(container["args"]), {})
    config = GatewayConfig.from_args(args, redis_url="r", admin_token="t", clusters=[])
    assert (config.metrics_host, config.metrics_port) == ("0.0.0.0", 9100)
    assert not args.no_auth
    workload = next(d for d in _docs(path) if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in workload["volumes"]}
    mount = next(m for m in container["volumeMounts"] if args.client_tokens.startswith(m["mountPath"] + "/"))
    assert volumes[mount["name"]]["secret"]["secretName"] == "fleetbatch-grpc-tokens"
    env = _k8s_env(container, {"fleetbatch-redis/password": "pw0123", "fleetbatch-admin/token": "a",
                               "fleetbatch-http/api-key": "h"})  # fmt: skip
    assert env["FLEETBATCH_REDIS_URL"] == "redis://:pw0123@redis:6379/0"
    engine = _k8s_env(_container(K8S / "engine" / "deployment.yaml"), {"fleetbatch-redis/password": "pw0123"})
    assert engine["FLEETBATCH_REDIS_URL"] == env["FLEETBATCH_REDIS_URL"]
    for overlay in (K8S / "overlays").glob("*/engine-patch.yaml"):  # the overlays keep the base's env
        assert "env" not in _container(overlay)


def test_the_redis_manifest_requires_its_password_and_keeps_it_off_command_lines(tmp_path):
    """The manifest's Redis command, run for real (loopback, a temp dir): a client without the password
    is refused, the gateway's rendered URL gets in, and no process' command line holds the password."""
    import redis

    from workqueue.embedded import find_redis_server

    container = _container(K8S / "base" / "redis.yaml")
    assert container["command"][:2] == ["sh", "-c"]
    password, port = "pw-" + os.urandom(12).hex(), _free_port()
    script = (
        container["command"][2]
        .replace("/run/redis", str(tmp_path))
        .replace("exec redis-server", f"exec {find_redis_server()}")
        + f" --port {port} --bind 127.0.0.1 --dir {tmp_path}"
    )
    env = dict(os.environ, **_k8s_env(container, {"fleetbatch-redis/password": password}))
    proc = subprocess.Popen(
        ["sh", "-c", script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        gateway_env = _k8s_env(_container(K8S / "base" / "gateway.yaml"), {
            "fleetbatch-redis/password": password, "fleetbatch-admin/token": "a", "fleetbatch-http/api-key": "h"
        })  # fmt: skip
        url = gateway_env["FLEETBATCH_REDIS_URL"].replace("@redis:6379", f"@127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        while True:
            try:
                assert redis.Redis.from_url(url).ping()
                break
            except redis.exceptions.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    "the manifest's redis did not start"
                )
                time.sleep(0.1)
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port).ping()
        assert password not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        assert (tmp_path / "auth.conf").stat().st_mode & 0o077 == 0
        if shutil.which("redis-cli"):  # the readiness probe passes with the password only
            probe = [
                c.replace("redis-cli", f"redis-cli -p {port}")
                for c in container["readinessProbe"]["exec"]["command"]
            ]
            assert subprocess.run(probe, env=env).returncode == 0
            assert subprocess.run(probe, env={**env, "REDIS_PASSWORD": "wrong"}).returncode != 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_image_copies_every_package_the_project_installs():
    """A package missing from the Dockerfile's COPY lines installs nowhere in the image (clusterfile once)."""
    import re
    import tomllib

    include = tomllib.loads((K8S.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"][
        "find"
    ]
    packages = {p.rstrip("*") for p in include["include"]}
    copied = set(re.findall(r"^COPY (\w+) \1$", (K8S / "Dockerfile").read_text(), re.M))
    assert packages <= copied, sorted(packages - copied)
