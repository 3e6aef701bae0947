"""The plan file (``plan.json``, schema version 1): written by the planner, read by the engines.

Fields: ``version``, ``model`` (name + hidden, layers, heads, kv_heads, intermediate, vocab),
``method``, ``devices`` (ordered: stage k runs on ``devices[stages[k].device_index]``; each has
``name``, ``type``, ``memory_bytes``, ``node`` and an optional ``slowdown`` >= 0, default 0: an
emulated slower device that takes ``1 + slowdown`` times as long, as ``fleetbatch engine serve --slowdown``,
and an optional ``cost``: the device's per-layer latency model, :mod:`planfile.device_cost`),
``stages`` (``layer_start``, ``layer_end`` exclusive, ``bits`` per layer, predicted memory (per
device) and prefill/decode seconds, optional ``tp_device_indices``: the devices of a
tensor-parallel stage, first = ``device_index``), ``kv_bits``, micro-batch sizes, workload, ``theta``, ``total_omega``,
predicted batch latency and throughput (generated tokens/s), ``solve_seconds``, and an optional
``head_split`` in [0, 1], default 0: the share of the LM head's vocabulary rows that the first
stage computes (the last stage computes the rest), to balance a head-heavy last stage.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from planfile.device_cost import DeviceCost, DeviceCostError

PLAN_VERSION = 1
MODEL_KEYS = ("name", "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab")


class PlanError(ValueError):
    """A plan file that does not follow the schema."""


@dataclass
class StagePlan:
    device_index: int
    layer_start: int
    layer_end: int
    bits: list[int]
    predicted_memory_bytes: int
    predicted_prefill_s: float
    predicted_decode_s: float
    # optional (tensor parallelism): every device of the stage's group, first = device_index;
    # absent (None) = the stage runs on device_index alone
    tp_device_indices: list[int] | None = None

    @property
    def devices_of_stage(self) -> list[int]:
        return list(self.tp_device_indices) if self.tp_device_indices else [self.device_index]


@dataclass
class Plan:
    model: dict[str, Any]
    method: str
    devices: list[dict[str, Any]]
    stages: list[StagePlan]
    kv_bits: int
    prefill_micro_batch: int
    decode_micro_batch: int
    batch_size: int
    prompt_len: int
    expected_output_tokens: int
    theta: float
    total_omega: float
    predicted_batch_latency_s: float
    predicted_throughput_tokens_per_s: float
    solve_seconds: float
    version: int = PLAN_VERSION
    head_split: float = 0.0  # share of the LM head's vocabulary rows computed by the first stage
    extra: dict[str, Any] = field(default_factory=dict)

    def layer_bits(self) -> list[int]:
        return [b for s in self.stages for b in s.bits]

    def device_cost(self, stage: int) -> DeviceCost | None:
        """The cost model of stage ``stage``'s device, None when the plan gives it none."""
        d = self.devices[self.stages[stage].device_index].get("cost")
        return None if d is None else DeviceCost.from_dict(d)

    def stage_of_layer(self, i: int) -> int:
        for k, s in enumerate(self.stages):
            if s.layer_start <= i < s.layer_end:
                return k
        raise IndexError(f"layer {i} is not in the plan (model has {self.model['layers']} layers)")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for st in d["stages"]:  # optional field: left out when unused, so such plans read as before
            if st.get("tp_device_indices") is None:
                st.pop("tp_device_indices", None)
        return d

    def validate(self) -> None:
        _validate(self.to_dict())


def _need(d: dict, key: str, types: type | tuple, where: str) -> Any:
    if key not in d:
        raise PlanError(f"{where}: missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise PlanError(f"{where}: field {key!r} must be {types}, got {v!r}")
    if not isinstance(v, types):
        raise PlanError(
            f"{where}: field {key!r} must be {getattr(types, '__name__', types)}, got {type(v).__name__}"
        )
    return v


def _validate(d: dict) -> None:
    if not isinstance(d, dict):
        raise PlanError("plan must be a JSON object")
    if d.get("version") != PLAN_VERSION:
        raise PlanError(f"plan version {d.get('version')!r} is not supported (expected {PLAN_VERSION})")
    model = _need(d, "model", dict, "plan")
    for k in MODEL_KEYS:
        _need(model, k, str if k == "name" else int, "plan.model")
    devices = _need(d, "devices", list, "plan")
    if not devices:
        raise PlanError("plan: 'devices' is empty")
    for i, dev in enumerate(devices):
        if not isinstance(dev, dict):
            raise PlanError(f"plan.devices[{i}] must be an object")
        for k, t in (("name", str), ("type", str), ("memory_bytes", int), ("node", str)):
            _need(dev, k, t, f"plan.devices[{i}]")
        slow = dev.get("slowdown", 0.0)
        if isinstance(slow, bool) or not isinstance(slow, (int, float)) or not 0 <= slow < math.inf:
            raise PlanError(f"plan.devices[{i}]: 'slowdown' must be a number >= 0, got {slow!r}")
        if dev.get("cost") is not None:
            try:
                DeviceCost.from_dict(dev["cost"], f"plan.devices[{i}].cost")
            except DeviceCostError as e:
                raise PlanError(str(e)) from None
    stages = _need(d, "stages", list, "plan")
    if not stages:
        raise PlanError("plan: 'stages' is empty")
    expect = 0
    num = (int, float)
    for k, s in enumerate(stages):
        w = f"plan.stages[{k}]"
        if not isinstance(s, dict):
            raise PlanError(f"{w} must be an object")
        di = _need(s, "device_index", int, w)
        if not 0 <= di < len(devices):
            raise PlanError(f"{w}: device_index {di} out of range (0..{len(devices) - 1})")
        lo, hi = _need(s, "layer_start", int, w), _need(s, "layer_end", int, w)
        if lo != expect or hi <= lo:
            raise PlanError(f"{w}: layers [{lo}, {hi}) do not continue from layer {expect}")
        expect = hi
        bits = _need(s, "bits", list, w)
        if len(bits) != hi - lo or not all(isinstance(b, int) and b in (2, 3, 4, 8, 16) for b in bits):
            raise PlanError(f"{w}: 'bits' must list one of 2/3/4/8/16 for each of its {hi - lo} layers")
        for key in ("predicted_memory_bytes", "predicted_prefill_s", "predicted_decode_s"):
            _need(s, key, num, w)
    if expect != model["layers"]:
        raise PlanError(f"plan: stages cover {expect} layers, model has {model['layers']}")
    used: list[int] = []
    for k, s in enumerate(stages):
        w = f"plan.stages[{k}]"
        tp = s.get("tp_device_indices")
        if tp is None:
            used.append(s["device_index"])
            continue
        if (
            not isinstance(tp, list)
            or not tp
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in tp)
        ):
            raise PlanError(f"{w}: 'tp_device_indices' must be a non-empty list of device indices")
        if tp[0] != s["device_index"]:
            raise PlanError(
                f"{w}: 'tp_device_indices' must start with the stage's device_index {s['device_index']}"
            )
        bad = [i for i in tp if not 0 <= i < len(devices)]
        if bad:
            raise PlanError(f"{w}: tp device index {bad[0]} out of range (0..{len(devices) - 1})")
        if len({(devices[i]["node"], devices[i]["type"]) for i in tp}) != 1:
            raise PlanError(f"{w}: tensor-parallel devices {tp} must be of one type on one node")
        if model["heads"] % len(tp) or model["kv_heads"] % len(tp):
            raise PlanError(f"{w}: {len(tp)} tensor-parallel devices do not divide the model's heads")
        used.extend(tp)
    if len(set(used)) != len(used):
        raise PlanError("plan: a device is used twice (by two stages or twice in one stage)")
    for k in (
        "kv_bits",
        "prefill_micro_batch",
        "decode_micro_batch",
        "batch_size",
        "prompt_len",
        "expected_output_tokens",
    ):
        v = _need(d, k, int, "plan")
        if v < 1:
            raise PlanError(f"plan: {k} must be >= 1, got {v}")
    if d["kv_bits"] not in (4, 8, 16):
        raise PlanError(f"plan: kv_bits must be 4, 8 or 16, got {d['kv_bits']}")
    _need(d, "method", str, "plan")
    for k in (
        "theta",
        "total_omega",
        "predicted_batch_latency_s",
        "predicted_throughput_tokens_per_s",
        "solve_seconds",
    ):
        _need(d, k, num, "plan")
    split = d.get("head_split", 0.0)
    if isinstance(split, bool) or not isinstance(split, num) or not 0 <= split <= 1:
        raise PlanError(f"plan: 'head_split' must be a number from 0 to 1, got {split!r}")
    if split > 0 and len(stages) < 2:
        raise PlanError("plan: 'head_split' needs at least 2 stages (it moves LM-head rows to the first)")


def plan_from_dict(d: dict) -> Plan:
    _validate(d)
    stages = [StagePlan(**{k: s[k] for k in StagePlan.__dataclass_fields__ if k in s}) for s in d["stages"]]
    kw = {k: d[k] for k in Plan.__dataclass_fields__ if k not in ("stages", "extra") and k in d}
    return Plan(stages=stages, extra=dict(d.get("extra", {})), **kw)


def save_plan(plan: Plan, path: str | Path) -> None:
    plan.validate()
    Path(path).write_text(json.dumps(plan.to_dict(), indent=2) + "\n")


def load_plan(path: str | Path) -> Plan:
    p = Path(path)
    if not p.exists():
        raise PlanError(f"plan file {p} not found")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise PlanError(f"plan file {p} is not JSON: {e}") from None
    try:
        return plan_from_dict(d)
    except PlanError as e:
        raise PlanError(f"{p}: {e}") from None
