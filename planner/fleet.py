"""A fleet described as devices, mapped onto this machine, and planned cluster by cluster.

A cluster file (:mod:`clusterfile`, YAML or JSON) names each cluster's devices by catalog type::

    version: 1
    clusters:
      - {name: fast, devices: [A100-40G, A100-40G]}
      - {name: medium, devices: [V100-32G, T4]}
      - {name: slow, devices: [T4, T4]}
    emulation:              # optional
      time_scale: 32        # the fleet's fastest device takes 32x this CPU's time at 16 bits
      reference: opt-30b    # the model whose catalog ratios and memory the devices keep

The devices are emulated on this machine for the *served* local model:

* **Time.** A device's samples are this CPU's profile of the served model (``fleetbatch engine profile``:
  one decoder layer, prefill and decode, and the LM head, at 16 bits), each scaled by the
  catalog roofline ratio of that device at that bit width to the fleet's fastest device at 16
  bits, on the reference model at the same batch and length, times ``time_scale``. So an A100
  keeps its ratio to a T4 in each phase, at each batch size and bit width (the T4's int4
  kernels included), anchored to what this CPU measured. The driver's host work is not scaled.
* **Memory.** A device's budget is the share of the served model's 16-bit layer weights that it
  would hold of the reference model's (its usable memory over the reference's 16-bit layer
  weights). Only layer weights count against it (``Problem.weights_only``): a tiny model's KV
  cache, embeddings and LM head outweigh its layers, which a real model's do not, and counting
  them would leave bits nothing to decide. They are granted apart: the plan's ``memory_bytes``,
  the engine's cap, adds them for the stage. With the default reference
  (opt-30b, 60 GB of 16-bit layers) two A100-40Gs hold the whole model at 16 bits, a V100-32G
  with a T4 must quantize about half of it, two T4s most of it.

Each cluster is then planned by the planner on its emulated devices (``plan_cluster``): the
ILP, or a baseline. The plans carry each device's cost model (``planfile.device_cost``), so
``fleetbatch engine serve --plan P --device-cost plan`` runs what was planned on the devices it was
planned for.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from clusterfile import ClusterFileError, Emulation, parse_cluster_file
from planner.catalog import DeviceType, device_type
from planner.cluster import DEFAULT_INTER_GBPS, Cluster, ClusterSpecError, Device
from planner.latency import Profile, lm_head_s, roofline_decode_s, roofline_prefill_s
from planner.memory import MemoryModel, usable_bytes
from planner.modelshape import ModelShape, load_shape

DEFAULT_TIME_SCALE = Emulation().time_scale  # the cluster file's defaults
DEFAULT_REFERENCE = Emulation().reference
DEFAULT_BITS = (4, 8, 16)

#: the fleet of ``fleetbatch gateway up`` (``--clusters default``) and ``fleetbatch loadgen demo``
DEFAULT_FLEET: dict[str, tuple[str, ...]] = {
    "fast": ("A100-40G", "A100-40G"),
    "medium": ("V100-32G", "T4"),
    "slow": ("T4", "T4"),
}


@dataclass(frozen=True)
class Fleet:
    """Clusters of catalog devices and how they are emulated here."""

    clusters: dict[str, tuple[str, ...]]
    time_scale: float = DEFAULT_TIME_SCALE
    reference: str = DEFAULT_REFERENCE

    def to_dict(self) -> dict:
        return {
            "clusters": {k: list(v) for k, v in self.clusters.items()},
            "emulation": {"time_scale": self.time_scale, "reference": self.reference},
        }

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def fleet_from_dict(spec: object, source: str = "cluster file") -> Fleet:
    """A :class:`Fleet` from a parsed cluster file whose clusters name catalog devices; a
    :class:`ClusterSpecError` naming what is wrong."""
    try:
        doc = parse_cluster_file(spec, source)
    except ClusterFileError as e:
        raise ClusterSpecError(str(e)) from None
    out: dict[str, tuple[str, ...]] = {}
    for c in doc.clusters:
        if not c.devices:
            raise ClusterSpecError(
                f"{source}: cluster {c.name!r}: a planned fleet names each cluster's devices"
            )
        try:
            out[c.name] = tuple(device_type(d).name for d in c.devices)
        except ValueError as e:
            raise ClusterSpecError(f"{source}: cluster {c.name!r}: {e}") from None
        if any(device_type(d).is_cpu for d in out[c.name]):
            raise ClusterSpecError(
                f"{source}: cluster {c.name!r}: a fleet names catalog GPUs; CPU is what emulates them"
            )
    try:
        load_shape(doc.emulation.reference)
    except ValueError as e:
        raise ClusterSpecError(f"{source}: emulation.reference: {e}") from None
    return Fleet(out, doc.emulation.time_scale, doc.emulation.reference)


def load_fleet(source: str | Path) -> Fleet:
    """The fleet of a cluster file (YAML/JSON), or ``default`` (:data:`DEFAULT_FLEET`)."""
    if str(source) == "default":
        return Fleet(dict(DEFAULT_FLEET))
    p = Path(source)
    if not p.is_file():
        raise ClusterSpecError(f"cluster file {p} not found")
    try:
        spec = json.loads(p.read_text()) if p.suffix.lower() == ".json" else yaml.safe_load(p.read_text())
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ClusterSpecError(f"cannot parse cluster file {p}: {e}") from None
    return fleet_from_dict(spec, str(p))


def anchor(fleet: Fleet, ref: ModelShape) -> DeviceType:
    """The fleet's fastest device: least 16-bit decode time per layer on the reference (8 queries, 512 tokens)."""
    types = {device_type(n) for devices in fleet.clusters.values() for n in devices}
    return min(types, key=lambda d: (roofline_decode_s(d, ref, 16, 8, 512), d.name))


def emulated_profile(
    dev: DeviceType,
    cpu: Profile,
    ref: ModelShape,
    anchor_dev: DeviceType,
    time_scale: float,
    bits: Sequence[int],
) -> Profile:
    """``dev``'s profile of the served model: this CPU's 16-bit samples scaled point by point by ``dev``'s
    roofline ratio (at each bit width) to the anchor's at 16 bits on the reference model, times ``time_scale``."""
    base = cpu.samples.get(16)
    if not base or not base.get("prefill") or not base.get("decode"):
        raise ValueError(
            "the CPU profile has no 16-bit prefill and decode samples (run `fleetbatch engine profile`)"
        )

    def scaled(rows, time_of, b: int) -> list[tuple[float, float, float]]:
        """Each ``(v, s, t)`` sample as ``dev`` takes it at ``b`` bits, by the roofline ratio."""
        return [
            (v, s, t * time_scale * time_of(dev, b, v, s) / time_of(anchor_dev, 16, v, s)) for v, s, t in rows
        ]

    def prefill(d: DeviceType, b: int, v: float, s: float) -> float:
        return roofline_prefill_s(d, ref, b, v, s)

    def decode(d: DeviceType, b: int, v: float, c: float) -> float:
        return roofline_decode_s(d, ref, b, v, c)

    def head(d: DeviceType, b: int, v: float, _: float) -> float:
        return lm_head_s(d, ref, v)  # the LM head stays at 16 bits

    samples = {
        b: {"prefill": scaled(base["prefill"], prefill, b), "decode": scaled(base["decode"], decode, b)}
        for b in bits
    }
    samples[16] = {
        **samples.get(16, {}),
        "head": scaled(base.get("head", []), head, 16),
        "driver": list(base.get("driver", [])),  # host work: not scaled
    }
    meta = {
        "emulates": dev.name,
        "on": cpu.device,
        "reference": ref.name,
        "anchor": anchor_dev.name,
        "time_scale": time_scale,
    }
    return Profile(dev.name, cpu.model, "emulated", samples, meta)


def emulated_memory(dev: DeviceType, shape: ModelShape, ref: ModelShape) -> int:
    """``dev``'s budget for the served model's layer weights: the share of the reference model's 16-bit
    layer weights that ``dev`` holds, of the served model's."""
    share = usable_bytes(dev) / (ref.layers * MemoryModel(ref, 1, 1, 1).layer_weight_bytes(16))
    return int(share * shape.layers * MemoryModel(shape, 1, 1, 1).layer_weight_bytes(16))


def emulated_cluster(name: str, devices: Sequence[str], shape: ModelShape, ref: ModelShape) -> Cluster:
    """Cluster ``name`` of emulated devices on one node (their links are this machine's, not modelled)."""
    devs = []
    for i, n in enumerate(devices):
        t = device_type(n)
        t = replace(t, memory_bytes=emulated_memory(t, shape, ref), emulated=True)
        devs.append(Device(f"{name}/{i}", t, name))
    return Cluster(name, tuple(devs), ((name, devs[0].type.intra_node_gbps),), DEFAULT_INTER_GBPS)


def fleet_profiles(
    fleet: Fleet, cpu: Profile, shape: ModelShape, bits: Sequence[int] = DEFAULT_BITS
) -> dict[str, Profile]:
    """One emulated profile per device type of the fleet, keyed by type name."""
    if cpu.model.get("hidden") != shape.hidden or cpu.model.get("layers") not in (None, shape.layers):
        raise ValueError(
            f"the CPU profile is of model {cpu.model.get('name')!r}, not {shape.name!r}: profile the served model"
        )
    ref = load_shape(fleet.reference)
    a = anchor(fleet, ref)
    names = sorted({n for devices in fleet.clusters.values() for n in devices})
    return {n: emulated_profile(device_type(n), cpu, ref, a, fleet.time_scale, bits) for n in names}


def fleet_clusters(fleet: Fleet, shape: ModelShape) -> dict[str, Cluster]:
    """Every cluster of ``fleet`` as emulated devices with their budgets for ``shape``."""
    ref = load_shape(fleet.reference)
    return {name: emulated_cluster(name, devs, shape, ref) for name, devs in fleet.clusters.items()}
