"""A small kustomize renderer for the project's k8s/ tree: what its kustomizations use, nothing else.

No packaged kustomize is at hand (Debian has none; PyPI's are wrappers that download a binary or
partial ports), so this renders the subset of kustomize's semantics that ``k8s/`` uses, and refuses
any other field of a kustomization (an overlay that starts using one fails here until it is added):

* ``resources``: manifest files and directories (a directory is a kustomization, rendered first);
* ``configMapGenerator``: ``files`` (``key=path`` or ``path``) to a ConfigMap whose name gets a hash
  of its content, as kustomize's does; references to it (volumes, ``envFrom``, ``configMapKeyRef``)
  follow the final name;
* ``patches``: strategic-merge patches by ``path`` (lists of containers, volumes, env, ports and
  volume mounts merge by their keys; other lists are replaced), matched by kind and name;
* ``namespace``, ``namePrefix``, ``nameSuffix``; ``labels`` (``pairs``, ``includeSelectors``,
  ``includeTemplates``); ``images`` (``name``, ``newName``, ``newTag``).

As in kustomize, a level's patches apply before its namespace, names and labels.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

KNOWN = {
    "apiVersion",
    "kind",
    "resources",
    "configMapGenerator",
    "patches",
    "namespace",
    "namePrefix",
    "nameSuffix",
    "labels",
    "images",
}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding", "StorageClass"}
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}

Doc = dict[str, Any]


class KustomizeError(ValueError):
    """A kustomization this renderer cannot render (or kustomize would refuse)."""


def read_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def render(directory: Path) -> list[Doc]:
    """The manifests ``kustomize build directory`` gives (within the subset above)."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text()) or {}
    unknown = set(spec) - KNOWN
    if unknown:
        raise KustomizeError(
            f"{directory}: kustomization fields this renderer does not know: {sorted(unknown)}"
        )
    docs: list[Doc] = []
    for ref in spec.get("resources", []):
        path = directory / ref
        docs += render(path) if path.is_dir() else read_docs(path)
    generated = [config_map(directory, g) for g in spec.get("configMapGenerator", [])]
    docs += generated
    for patch in spec.get("patches", []):
        apply_patch(docs, directory, patch)
    renames = {}
    for doc in docs:
        meta = doc.setdefault("metadata", {})
        if spec.get("namespace") and doc["kind"] not in CLUSTER_SCOPED:
            meta["namespace"] = spec["namespace"]
        if doc["kind"] != "Namespace":
            new = spec.get("namePrefix", "") + meta["name"] + spec.get("nameSuffix", "")
            if doc["kind"] == "ConfigMap":
                renames[meta["name"]] = new
            meta["name"] = new
    for label in spec.get("labels", []):
        add_labels(docs, label)
    for doc in generated:  # the content hash comes last, on the final name
        old = doc["metadata"]["name"]
        doc["metadata"]["name"] = renames[doc.pop("_generated")] = f"{old}-{content_hash(doc)}"
    for image in spec.get("images", []):
        set_image(docs, image)
    for doc in docs:
        rename_config_maps(doc, renames)
    return docs


def config_map(directory: Path, gen: Doc) -> Doc:
    unknown = set(gen) - {"name", "files"}
    if unknown:
        raise KustomizeError(f"{directory}: configMapGenerator fields not supported: {sorted(unknown)}")
    data = {}
    for entry in gen.get("files", []):
        key, _, path = entry.rpartition("=")
        data[key or Path(path).name] = (directory / path).read_text()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": gen["name"]},
        "data": data,
        "_generated": gen["name"],
    }


def content_hash(cm: Doc) -> str:
    """kustomize's name suffix of a generated ConfigMap: its kind, name and data hashed, 10 characters
    without vowels or characters that read as others."""
    encoded = json.dumps(
        {"data": cm.get("data", {}), "kind": "ConfigMap", "name": cm["metadata"]["name"]},
        sort_keys=True,
        separators=(",", ":"),
    )
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans({"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"}))


def apply_patch(docs: list[Doc], directory: Path, patch: Doc) -> None:
    if set(patch) != {"path"}:
        raise KustomizeError(f"{directory}: only strategic-merge patches by path are supported, not {patch}")
    for p in read_docs(directory / patch["path"]):
        targets = [
            d for d in docs if d["kind"] == p["kind"] and d["metadata"]["name"] == p["metadata"]["name"]
        ]
        if len(targets) != 1:
            raise KustomizeError(f"{directory / patch['path']}: {len(targets)} resources match {p['kind']} "
                                 f"{p['metadata']['name']}")  # fmt: skip
        merged = merge(targets[0], p)
        targets[0].clear()
        targets[0].update(merged)


def merge(base: Any, patch: Any, field: str = "") -> Any:
    """A strategic merge of ``patch`` into ``base`` (null deletes a field)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if isinstance(k, str) and k.startswith("$"):
                raise KustomizeError(f"patch directive {k} not supported")
            if v is None:
                out.pop(k, None)
            else:
                out[k] = merge(out[k], v, k) if k in out else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key, out = MERGE_KEYS[field], [copy.deepcopy(b) for b in base]
        for item in patch:
            at = next((i for i, b in enumerate(out) if b.get(key) == item.get(key)), None)
            if at is None:
                out.append(copy.deepcopy(item))
            else:
                out[at] = merge(out[at], item)
        return out
    return copy.deepcopy(patch)


def add_labels(docs: list[Doc], label: Doc) -> None:
    pairs = label["pairs"]
    selectors = label.get("includeSelectors", False)
    templates = selectors or label.get("includeTemplates", False)
    for doc in docs:
        doc["metadata"].setdefault("labels", {}).update(pairs)
        spec = doc.get("spec", {})
        if doc["kind"] in WORKLOADS:
            if templates:
                spec["template"].setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
            if selectors:
                spec.setdefault("selector", {}).setdefault("matchLabels", {}).update(pairs)
        elif doc["kind"] == "Service" and selectors:
            spec.setdefault("selector", {}).update(pairs)


def containers(doc: Doc) -> list[Doc]:
    if doc["kind"] not in WORKLOADS:
        return []
    pod = doc["spec"]["template"]["spec"]
    return pod.get("initContainers", []) + pod.get("containers", [])


def set_image(docs: list[Doc], image: Doc) -> None:
    for doc in docs:
        for c in containers(doc):
            name, _, tag = c["image"].partition(":")
            if name == image["name"]:
                c["image"] = image.get("newName", name) + ":" + image.get("newTag", tag or "latest")


def rename_config_maps(doc: Doc, renames: dict[str, str]) -> None:
    if doc["kind"] not in WORKLOADS:
        return
    pod = doc["spec"]["template"]["spec"]
    refs = [v["configMap"] for v in pod.get("volumes", []) if "configMap" in v]
    refs += [s["configMap"] for v in pod.get("volumes", []) for s in v.get("projected", {}).get("sources", [])
             if "configMap" in s]  # fmt: skip
    for c in containers(doc):
        refs += [e["configMapRef"] for e in c.get("envFrom", []) if "configMapRef" in e]
        refs += [
            e["valueFrom"]["configMapKeyRef"]
            for e in c.get("env", [])
            if "configMapKeyRef" in e.get("valueFrom", {})
        ]
    for ref in refs:
        ref["name"] = renames.get(ref["name"], ref["name"])
