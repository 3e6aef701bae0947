"""The k8s tree rendered and checked: the base, the engine and every overlay render (tests/kustomize.py),
every manifest they give validates against the Kubernetes schemas (kubernetes-validate, strict), and
every container of the fleetbatch image runs a command its own CLI parser accepts, whose config files
are keys of the ConfigMaps mounted where it reads them. A wrong flag, a misspelt field or a missing
plan file in a manifest fails it (the mutation tests, on a copy of the tree)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import yaml

from fleetbatch.cli import part_parser
from tests.kustomize import containers, render

try:
    import kubernetes_validate
except ImportError:  # a test extra: scripts/setup.sh installs it (pip install -e ".[test]")
    kubernetes_validate = None

K8S = Path(__file__).resolve().parent.parent / "k8s"
KUBERNETES_VERSION = (
    "1.33.0"  # the oldest release the manifests promise to fit (kubernetes-validate's schemas)
)
IMAGE = "fleetbatch"
PARTS = ("gateway", "engine")  # the parts a container of the image runs: `fleetbatch <part> ...`


def targets(root: Path) -> list[Path]:
    """The base, the engine template and every overlay: each directory one applies with ``kubectl -k``."""
    return [root / "base", root / "engine", *sorted(p for p in (root / "overlays").iterdir() if p.is_dir())]


def image_entrypoint(root: Path) -> tuple[list[str], list[str]]:
    """The Dockerfile's ``ENTRYPOINT`` and ``CMD`` (exec form)."""
    lines = (root / "Dockerfile").read_text().splitlines()
    entry = next(json.loads(x.split(None, 1)[1]) for x in lines if x.startswith("ENTRYPOINT"))
    cmd = next(json.loads(x.split(None, 1)[1]) for x in lines if x.startswith("CMD"))
    return entry, cmd


def command_problems(doc: dict, root: Path, config_maps: dict[str, dict]) -> list[str]:
    """What is wrong with the commands of ``doc``'s containers of the fleetbatch image: a program that is
    not one of the CLIs, arguments its parser refuses, a file under a ConfigMap's mount that the
    ConfigMap lacks."""
    entry, cmd = image_entrypoint(root)
    pod = doc["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    out = []
    for c in containers(doc):
        if not c["image"].startswith(IMAGE + ":"):
            continue
        where = f"{doc['kind']} {doc['metadata']['name']}, container {c['name']}"
        command = c.get("command") or entry
        args = c.get("args", [] if "command" in c else cmd)
        program, args = command[0], command[1:] + args
        if program != "fleetbatch" or not args or args[0] not in PARTS:
            out.append(
                f"{where}: runs {' '.join([program, *args[:1]])!r}, not `fleetbatch` and one of {PARTS}"
            )
            continue
        part, args = args[0], args[1:]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                part_parser(part).parse_args(args)
        except SystemExit:
            why = (err.getvalue().strip().splitlines() or ["no message"])[-1]
            out.append(f"{where}: its parser refuses `fleetbatch {part} {' '.join(args)}`: {why}")
        for m in c.get("volumeMounts", []):
            cm = volumes.get(m["name"], {}).get("configMap")
            for a in args:
                if cm and a.startswith(m["mountPath"] + "/"):
                    key = a[len(m["mountPath"]) + 1 :]
                    if key not in config_maps.get(cm["name"], {}).get("data", {}):
                        out.append(f"{where}: {a} is not a key of the ConfigMap {cm['name']} mounted there")
    return out


def problems(root: Path) -> list[str]:
    """Everything wrong with the k8s tree at ``root``: rendering, schemas, commands."""
    assert kubernetes_validate is not None, "kubernetes-validate is missing: pip install -e '.[test]'"
    out = []
    for target in targets(root):
        docs = render(target)
        if not docs:
            out.append(f"{target}: renders nothing")
        maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
        for doc in docs:
            name = f"{target.relative_to(root)}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                out.append(f"{name}: {'.'.join(str(p) for p in e.path)}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                out.append(f"{name}: {e.message}")
            if doc.get("kind") in ("Deployment", "StatefulSet"):
                out += [f"{target.relative_to(root)}: {p}" for p in command_problems(doc, root, maps)]
    return out


def test_every_kustomization_renders_validates_and_runs_commands_its_clis_accept():
    assert problems(K8S) == []


def test_the_overlays_render_as_kustomize_would():
    overlay = render(K8S / "overlays" / "aws-a100")
    deployment = next(d for d in overlay if d["kind"] == "Deployment")
    plan = next(d for d in overlay if d["kind"] == "ConfigMap")
    assert deployment["metadata"] == {
        "name": "engine-aws-a100",
        "namespace": "fleetbatch",
        "labels": {"fleetbatch/cluster": "aws-a100"},
    }
    assert deployment["spec"]["selector"]["matchLabels"] == {
        "app": "engine",
        "fleetbatch/cluster": "aws-a100",
    }
    pod = deployment["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    assert engine["args"][engine["args"].index("--cluster") + 1] == "aws-a100"
    assert [e["name"] for e in engine["env"]] == [
        "REDIS_PASSWORD",
        "FLEETBATCH_REDIS_URL",
    ]  # kept from the base
    assert engine["resources"] == {
        "requests": {"cpu": "2", "memory": "8Gi"},
        "limits": {"nvidia.com/gpu": "4"},
    }
    assert plan["metadata"]["name"].startswith("plan-aws-a100-aws-a100-")
    assert (
        next(v for v in pod["volumes"] if v["name"] == "plan")["configMap"]["name"]
        == plan["metadata"]["name"]
    )
    assert set(plan["data"]) == {"aws-a100.json"}
    base = render(K8S / "base")
    assert {d["metadata"].get("namespace") for d in base if d["kind"] != "Namespace"} == {"fleetbatch"}


def _mutated(tmp_path: Path, rel: str, old: str, new: str) -> Path:
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root, ignore=shutil.ignore_patterns("grafana"))
    path = root / rel
    text = path.read_text()
    assert old in text, f"{rel} no longer holds {old!r}: update the mutation"
    path.write_text(text.replace(old, new, 1))
    return root


@pytest.mark.parametrize(
    ("rel", "old", "new", "expect"),
    [
        ("overlays/gcp-t4/engine-patch.yaml", '"--backend", "vllm"', '"--backendd", "vllm"', "--backendd"),
        ("base/gateway.yaml", '"--metrics-port", "9100"', '"--metrics-prot", "9100"', "--metrics-prot"),
        ("engine/deployment.yaml", '"--backend", "native"', '"--backend", "tensorrt"', "tensorrt"),
        ("overlays/azure-v100/kustomization.yaml", "azure-v100.json=plan.json", "v100.json=plan.json",
         "/plans/azure-v100.json"),
        ("engine/deployment.yaml", "terminationGracePeriodSeconds", "terminationGraceSeconds",
         "terminationGraceSeconds"),
        ("base/redis.yaml", "kind: StatefulSet", "kind: StatefulSets", "StatefulSets"),
    ],
)  # fmt: skip
def test_a_broken_manifest_fails_the_check(tmp_path, rel, old, new, expect):
    found = problems(_mutated(tmp_path, rel, old, new))
    assert found and any(expect in p for p in found), found


def test_the_renderer_refuses_what_it_does_not_know(tmp_path):
    root = _mutated(
        tmp_path,
        "engine/kustomization.yaml",
        "resources:",
        "replicas: [{name: engine, count: 2}]\nresources:",
    )
    with pytest.raises(ValueError, match="replicas"):
        render(root / "engine")
    assert yaml.safe_load((root / "engine" / "kustomization.yaml").read_text())["replicas"]
