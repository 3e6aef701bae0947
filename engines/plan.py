"""Optional plan file (``plan.json`` from the planner): stages, per-layer bits, micro-batch limits.

Reads and validates the plan with :func:`planfile.load_plan` (the plan file schema, a shared
contract at the bottom; the engines do not import the planner). Per-layer bit
widths are applied to the model with :func:`quant.apply.apply_bitmap` by
:func:`quantized_model` (on a copy) when the plan's layer count matches the model's; otherwise that is
reported back, not silently dropped.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

from engines.config import EngineConfig, PipelineConfig
from engines.stage_spec import StageSpec
from planfile import Plan, load_plan
from quant.apply import apply_bitmap, decoder_layers

log = logging.getLogger(__name__)


def _read(path: str) -> Plan:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"plan file {p} not found")
    return load_plan(p)


def plan_stages(path: str, num_layers: int | None = None, even_split: bool = False) -> list[StageSpec]:
    """The plan's stages in order: layer range and its bits, the device's ``slowdown``, memory cap and
    cost model (``None`` where it has none), predictions.

    ``even_split`` keeps the plan's devices but splits the layers evenly over them (the baseline
    a planned partition is measured against).
    """
    plan = _read(path)
    ranges = [(st.layer_start, st.layer_end) for st in plan.stages]
    layers = num_layers or plan.stages[-1].layer_end
    if even_split:
        if len(ranges) > layers:
            raise ValueError(f"cannot split {layers} layers evenly over {len(ranges)} stages")
        cuts = [round(k * layers / len(ranges)) for k in range(len(ranges) + 1)]
        ranges = list(zip(cuts, cuts[1:], strict=False))
    bits = plan.layer_bits()
    if len(bits) != layers:  # another model's plan: no bits (its quantization is skipped too)
        bits = []
    out = []
    for k, (st, (lo, hi)) in enumerate(zip(plan.stages, ranges, strict=True)):
        dev = plan.devices[st.device_index]
        mem = dev.get("memory_bytes")
        out.append(
            StageSpec(
                index=k,
                layer_start=lo,
                layer_end=hi,
                slowdown=float(dev.get("slowdown", 0.0) or 0.0),
                memory_bytes=int(mem) if mem else None,
                device_name=str(dev.get("type", dev.get("name", ""))),
                predicted_prefill_s=float(st.predicted_prefill_s),
                predicted_decode_s=float(st.predicted_decode_s),
                cost=plan.device_cost(k),
                layer_bits=tuple(bits[lo:hi]),
            )
        )
    return out


def plan_head_split(path: str, config: PipelineConfig) -> float:
    """The share of the LM head's rows the plan gives the first stage; 0 for the baselines that keep
    the head on the last stage as vLLM does (``even_split``, or ``head_split`` off)."""
    return 0.0 if config.even_split or not config.head_split else float(_read(path).head_split)


def apply_plan(config: EngineConfig) -> list[str]:
    """Apply the plan's micro-batch sizes to ``config`` in place; returns notes on what was applied or skipped.

    The decode micro-batch caps the decoding queries of one micro-batch and, times the number of
    stages, the running batch (so every stage has a full micro-batch in flight); the prefill
    micro-batch caps the prefilling queries of one micro-batch.
    """
    plan = _read(config.plan_path or "")
    num_stages = len(plan.stages)
    decode, prefill = plan.decode_micro_batch, plan.prefill_micro_batch
    config.decode_micro_batch = decode
    config.max_running = decode * num_stages
    config.prefill_micro_batch = prefill
    notes = [
        f"max_running={decode * num_stages} from the plan's decode micro-batch x {num_stages} stage(s)",
        f"at most {prefill} prefilling queries per micro-batch (the plan's prefill micro-batch)",
    ]
    if any(st.tp_device_indices for st in plan.stages):
        notes.append(
            "tensor-parallel stages in the plan are not run by the native engine (one device per process)"
        )
    for n in notes:
        log.info("plan %s: %s", config.plan_path, n)
    return notes


def plan_layer_bits(path: str) -> list[int]:
    """Bits of every decoder layer in layer order, from the plan's stages."""
    return _read(path).layer_bits()


def quantized_model(model, path: str, group_size: int | None = 128, copy_model: bool = True):
    """``(model, notes)``: ``model``'s decoder layers quantized to the plan's bit map. The quantized
    model is a copy unless ``copy_model`` is False (the caller hands ``model`` over); a plan that
    quantizes nothing (no bits, all 16, or another layer count, reported) returns ``model`` itself."""
    bits = plan_layer_bits(path)
    n_layers = len(decoder_layers(model))
    if not bits:
        return model, ["the plan has no per-layer bits"]
    if len(bits) != n_layers:
        note = f"plan bits for {len(bits)} layers, model has {n_layers}: per-layer bits NOT applied"
        log.warning("plan %s: %s", path, note)
        return model, [note]
    if all(b >= 16 for b in bits):
        return model, ["plan keeps every layer at 16 bits"]
    if copy_model:
        model = copy.deepcopy(model)
    apply_bitmap(model, bits, group_size=group_size)
    note = f"per-layer bits applied: {sorted(set(bits))} over {n_layers} layers"
    log.info("plan %s: %s", path, note)
    return model, [note]
