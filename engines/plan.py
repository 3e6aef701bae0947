"""Optional plan file (``plan.json`` from the planner): stages, per-layer bits, micro-batch limits.

Reads the plan through ``planner.planfile.load_plan`` when that module exists (the one
sanctioned import of planner code: reading plan files), else as plain JSON. Per-layer bit
widths are applied to the model with :func:`quant.apply.apply_bitmap` by
:func:`apply_plan_bits` when the plan's layer count matches the model's; otherwise that is
reported back, not silently dropped.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engines.config import EngineConfig
from engines.pipeline import StageSpec

log = logging.getLogger(__name__)


def _read(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"plan file {p} not found")
    try:
        from planner.planfile import load_plan  # type: ignore[import-not-found]
    except ImportError:
        load_plan = None
    if load_plan is not None:
        plan = load_plan(str(p))
        return plan if isinstance(plan, dict) else getattr(plan, "__dict__", {})
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"plan file {p} is not valid JSON ({e.msg})") from e


def _first_int(plan: dict, *keys: str) -> int | None:
    for k in keys:
        v = plan.get(k)
        if isinstance(v, list) and v:
            v = max(v)
        if isinstance(v, int | float) and v > 0:
            return int(v)
    return None


def _rows(plan: dict, key: str) -> list[dict]:
    return [st if isinstance(st, dict) else getattr(st, "__dict__", {}) for st in plan.get(key) or []]


def plan_stages(path: str, num_layers: int | None = None, even_split: bool = False) -> list[StageSpec]:
    """The plan's stages in order: layer range, the device's ``slowdown`` and memory cap, predictions.

    ``even_split`` keeps the plan's devices but splits the layers evenly over them (the baseline
    a planned partition is measured against).
    """
    plan = _read(path)
    devices = _rows(plan, "devices")
    rows = sorted(_rows(plan, "stages"), key=lambda s: s.get("layer_start", 0))
    if not rows:
        raise ValueError(f"plan {path} has no stages")
    layers = num_layers or max(int(r.get("layer_end", 0)) for r in rows)
    if even_split:
        if len(rows) > layers:
            raise ValueError(f"cannot split {layers} layers evenly over {len(rows)} stages")
        cuts = [round(k * layers / len(rows)) for k in range(len(rows) + 1)]
        rows = [{**r, "layer_start": cuts[k], "layer_end": cuts[k + 1]} for k, r in enumerate(rows)]
    out = []
    for k, r in enumerate(rows):
        dev = devices[r.get("device_index", k)] if r.get("device_index", k) < len(devices) else {}
        mem = dev.get("memory_bytes")
        out.append(
            StageSpec(
                index=k,
                layer_start=int(r["layer_start"]),
                layer_end=int(r["layer_end"]),
                slowdown=float(dev.get("slowdown", 0.0) or 0.0),
                memory_bytes=int(mem) if mem else None,
                device_name=str(dev.get("type", dev.get("name", ""))),
                predicted_prefill_s=float(r.get("predicted_prefill_s", 0.0)),
                predicted_decode_s=float(r.get("predicted_decode_s", 0.0)),
            )
        )
    return out


def apply_plan(config: EngineConfig) -> list[str]:
    """Apply the plan's micro-batch sizes to ``config`` in place; returns notes on what was applied or skipped.

    The decode micro-batch caps the decoding queries of one micro-batch and, times the number of
    stages, the running batch (so every stage has a full micro-batch in flight); the prefill
    micro-batch caps the prefilling queries of one micro-batch.
    """
    plan = _read(config.plan_path or "")
    notes = []
    stages = _rows(plan, "stages")
    num_stages = max(1, len(stages))
    decode = _first_int(plan, "decode_micro_batch", "decode_batch_size", "decode_micro_batch_sizes")
    prefill = _first_int(plan, "prefill_micro_batch", "prefill_batch_size", "prefill_micro_batch_sizes")
    if decode:
        config.decode_micro_batch = decode
        config.max_running = decode * num_stages
        notes.append(
            f"max_running={decode * num_stages} from the plan's decode micro-batch x {num_stages} stage(s)"
        )
    if prefill:
        config.prefill_micro_batch = prefill
        notes.append(f"at most {prefill} prefilling queries per micro-batch (the plan's prefill micro-batch)")
    if any(st.get("tp_device_indices") for st in stages):
        notes.append(
            "tensor-parallel stages in the plan are not run by the native engine (one device per process)"
        )
    for n in notes:
        log.info("plan %s: %s", config.plan_path, n)
    return notes


def plan_layer_bits(path: str) -> list[int]:
    """Bits of every decoder layer in layer order, from the plan's stages."""
    plan = _read(path)
    stages = plan.get("stages") or []
    rows = [s if isinstance(s, dict) else getattr(s, "__dict__", {}) for s in stages]
    rows.sort(key=lambda s: s.get("layer_start", 0))
    return [int(b) for s in rows for b in s.get("bits", [])]


def apply_plan_bits(model, path: str, group_size: int | None = 128) -> list[str]:
    """Quantize ``model``'s decoder layers to the plan's bit map (in place); returns notes."""
    from quant.apply import apply_bitmap, decoder_layers

    bits = plan_layer_bits(path)
    n_layers = len(decoder_layers(model))
    if not bits:
        return ["the plan has no per-layer bits"]
    if len(bits) != n_layers:
        note = f"plan bits for {len(bits)} layers, model has {n_layers}: per-layer bits NOT applied"
        log.warning("plan %s: %s", path, note)
        return [note]
    if all(b >= 16 for b in bits):
        return ["plan keeps every layer at 16 bits"]
    apply_bitmap(model, bits, group_size=group_size)
    note = f"per-layer bits applied: {sorted(set(bits))} over {n_layers} layers"
    log.info("plan %s: %s", path, note)
    return [note]
