"""Cluster specs: devices grouped in nodes, with link bandwidth inside and between nodes.

A spec is YAML or JSON::

    name: 3xP100+V100
    inter_node_gbps: 100          # Gb/s between nodes
    nodes:
      - name: p100s
        intra_node_gbps: 128      # Gb/s between devices of this node (default: the device type's, catalog)
        devices: [P100, P100, P100]
      - name: v100
        devices: [{type: V100, count: 1}]
      - name: box                 # unlike devices emulated on one machine
        devices:
          - {type: CPU, count: 1}
          - {type: CPU, count: 1, slowdown: 1.0, memory_gib: 2}

A device entry is a type name or a mapping with ``type`` and optional ``count`` (default 1),
``memory_gib`` (a memory cap) and ``slowdown`` (default 0: the device takes ``1 + slowdown``
times as long, as with ``fleetbatch engine serve --slowdown``; its type is renamed e.g. ``CPU@x2`` and the
planner scales the base type's profile, see ``planner.catalog.with_slowdown``).

A shorthand string such as ``"3xT4+V100"`` gives one node per device type.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from planner.catalog import GIB, DeviceType, device_type, with_memory, with_slowdown

DEFAULT_INTRA_GBPS = 128.0
DEFAULT_INTER_GBPS = 100.0


@dataclass(frozen=True)
class Device:
    """One physical device of a cluster."""

    name: str
    type: DeviceType
    node: str


@dataclass(frozen=True)
class Cluster:
    name: str
    devices: tuple[Device, ...]
    node_intra_gbps: tuple[tuple[str, float], ...]
    inter_node_gbps: float

    def bandwidth_bytes_per_s(self, i: int, j: int) -> float:
        """Link bandwidth between devices ``i`` and ``j`` in bytes/s."""
        a, b = self.devices[i], self.devices[j]
        gbps = dict(self.node_intra_gbps)[a.node] if a.node == b.node else self.inter_node_gbps
        return gbps * 1e9 / 8

    def describe(self) -> str:
        return f"{self.name}: " + ", ".join(f"{d.name}({d.type.name}@{d.node})" for d in self.devices)


class ClusterSpecError(ValueError):
    """A cluster spec that cannot be read."""


def _device_entry(entry: object, nname: str) -> tuple[DeviceType, int]:
    """One device entry of node ``nname``: its device type (memory cap, slowdown applied) and count."""
    if isinstance(entry, str):
        tname, count, mem, slow = entry, 1, None, 0.0
    elif isinstance(entry, dict) and "type" in entry:
        tname, mem, slow = entry["type"], entry.get("memory_gib"), entry.get("slowdown", 0.0)
        try:
            count = int(entry.get("count", 1))
        except (TypeError, ValueError):
            raise ClusterSpecError(
                f"node {nname!r}: device count must be an integer, got {entry.get('count')!r}"
            ) from None
    else:
        raise ClusterSpecError(f"node {nname!r}: device entry {entry!r} needs a 'type'")
    if count < 1:
        raise ClusterSpecError(f"node {nname!r}: device count must be >= 1, got {count}")
    try:
        dt = device_type(str(tname))
    except ValueError as e:
        raise ClusterSpecError(str(e)) from None
    if mem is not None:
        dt = with_memory(dt, int(float(mem) * GIB))
    try:
        if isinstance(slow, bool) or not isinstance(slow, (int, float)):
            raise ValueError
        dt = with_slowdown(dt, slow)
    except ValueError:
        raise ClusterSpecError(
            f"node {nname!r}: device {tname!r}: slowdown must be a number >= 0, got {slow!r}"
        ) from None
    return dt, count


def _check_type_names(devices: list[Device]) -> None:
    """Latency models are keyed by type name: one name must mean one speed."""
    seen: dict[str, float] = {}
    for d in devices:
        if seen.setdefault(d.type.name, d.type.slowdown) != d.type.slowdown:
            raise ClusterSpecError(
                f"device type name {d.type.name!r} is used with slowdowns {seen[d.type.name]} and "
                f"{d.type.slowdown}; use slowdowns that differ more"
            )


def cluster_from_dict(spec: dict, default_name: str = "cluster") -> Cluster:
    if not isinstance(spec, dict):
        raise ClusterSpecError("cluster spec must be a mapping with a 'nodes' list")
    nodes = spec.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ClusterSpecError("cluster spec needs a non-empty 'nodes' list")
    devices: list[Device] = []
    intra: list[tuple[str, float]] = []
    for ni, node in enumerate(nodes):
        if not isinstance(node, dict) or "devices" not in node:
            raise ClusterSpecError(f"node #{ni} needs a 'devices' list")
        nname = str(node.get("name", f"node{ni}"))
        if any(n == nname for n, _ in intra):
            raise ClusterSpecError(f"duplicate node name {nname!r}")
        first = len(devices)
        for entry in node["devices"]:
            dt, count = _device_entry(entry, nname)
            for _ in range(count):
                devices.append(Device(f"{nname}/{len(devices)}", dt, nname))
        # explicit node value, else the spec's, else the slowest default link of the node's device types
        types_bw = [d.type.intra_node_gbps for d in devices[first:]]
        default_bw = min(types_bw) if types_bw else DEFAULT_INTRA_GBPS
        bw = float(node.get("intra_node_gbps", spec.get("intra_node_gbps", default_bw)))
        if bw <= 0:
            raise ClusterSpecError(f"node {nname!r}: intra_node_gbps must be positive")
        intra.append((nname, bw))
    if not devices:
        raise ClusterSpecError("cluster spec has no devices")
    _check_type_names(devices)
    inter = float(spec.get("inter_node_gbps", DEFAULT_INTER_GBPS))
    if inter <= 0:
        raise ClusterSpecError("inter_node_gbps must be positive")
    return Cluster(str(spec.get("name", default_name)), tuple(devices), tuple(intra), inter)


_TERM = re.compile(r"^\s*(?:(\d+)\s*[x\*]\s*)?([A-Za-z0-9\-]+)\s*$")


def cluster_from_shorthand(text: str, inter_node_gbps: float = DEFAULT_INTER_GBPS) -> Cluster:
    """``"3xT4+V100"`` -> one node per device type, ``inter_node_gbps`` between nodes."""
    nodes: dict[str, int] = {}
    for term in text.split("+"):
        m = _TERM.match(term)
        if not m:
            raise ClusterSpecError(f"cannot read cluster term {term!r} in {text!r} (expected e.g. '3xT4')")
        count, tname = int(m.group(1) or 1), m.group(2)
        nodes[tname] = nodes.get(tname, 0) + count
    spec = {
        "name": text,
        "inter_node_gbps": inter_node_gbps,
        "nodes": [{"name": t, "devices": [{"type": t, "count": c}]} for t, c in nodes.items()],
    }
    return cluster_from_dict(spec, text)


def load_cluster(source: str | Path) -> Cluster:
    """A cluster from a YAML/JSON file, or from a shorthand string like ``3xT4+V100``."""
    p = Path(source)
    if p.suffix.lower() in (".yaml", ".yml", ".json") or p.exists():
        if not p.exists():
            raise ClusterSpecError(f"cluster spec file {p} not found")
        text = p.read_text()
        try:
            spec = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ClusterSpecError(f"cannot parse cluster spec {p}: {e}") from None
        return cluster_from_dict(spec, p.stem)
    return cluster_from_shorthand(str(source))


#: the clusters of the LLM-PQ / SplitQuant evaluations
PAPER_CLUSTERS: tuple[str, ...] = (
    "1xV100",
    "V100+A100",
    "2xV100+A100",
    "3xV100+A100",
    "3xT4+V100",
    "3xP100+V100",
    "4xT4+2xV100",
    "4xT4",
    "4xV100",
    "4xA100",
)
