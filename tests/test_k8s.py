"""The Kubernetes manifests parse, every kustomization reference exists, and clusters.yaml is valid."""

from __future__ import annotations

from pathlib import Path

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
    assert args[args.index("--files-dir") + 1] in mounts
    exposed = next(x for x in (K8S / "Dockerfile").read_text().splitlines() if x.startswith("EXPOSE"))
    assert set(served.values()) <= {int(p) for p in exposed.split()[1:]}
