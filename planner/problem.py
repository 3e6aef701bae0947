"""Assemble a planning ``Problem``: latency models (measured profiles or catalog rooflines) and the quality indicator."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from planner.catalog import DeviceType
from planner.cluster import Cluster
from planner.costs import Problem, Workload
from planner.latency import LatencyModel, Profile, fit_profile, roofline_profile
from planner.modelshape import ModelShape
from quant.omega import load_indicator, synthetic_indicator

log = logging.getLogger(__name__)


def latency_models(
    cluster: Cluster, shape: ModelShape, bits: tuple[int, ...], profiles: Mapping[str, Profile] | None = None
) -> dict[str, LatencyModel]:
    """One fitted model per device type: from a measured profile when one is given, else from the roofline.

    A type with a ``slowdown`` (``planner.catalog.with_slowdown``) takes its profile by its own
    name, else by its base name (``CPU@x2`` -> ``CPU``); profiles are of the real hardware (the
    profiler does not emulate slowdowns), so the fitted model, or the roofline one, is scaled by
    ``1 + slowdown``: that scales a measured LM head (``LatencyModel.head_coef``) too, once, and
    ``Problem.head_s`` uses it as it is.
    """
    out: dict[str, LatencyModel] = {}
    profiles = profiles or {}
    for d in cluster.devices:
        name = d.type.name
        if name in out:
            continue
        prof = profiles.get(name)
        if prof is None:
            prof = profiles.get(d.type.base_name)
        lm = _fit(d.type, shape, bits, prof)
        if d.type.slowdown > 0:
            lm = replace(lm.scaled(d.type.speed_factor), device=name)
        out[name] = lm
    return out


def _fit(dev: DeviceType, shape: ModelShape, bits: tuple[int, ...], prof: Profile | None) -> LatencyModel:
    """The unscaled latency model of ``dev``: ``prof`` fitted (missing bits from the roofline; its LM head
    if it timed one for this vocabulary), else the roofline (no measured head)."""
    if prof is None:
        return fit_profile(roofline_profile(dev, shape, bits), bits)
    name = dev.name
    if prof.model.get("hidden") != shape.hidden or prof.model.get("intermediate") != shape.intermediate:
        raise ValueError(
            f"profile for {name} was measured on model {prof.model.get('name')!r}, not {shape.name!r}; "
            "profile the same model shape or leave the profile out to use the roofline"
        )
    samples = prof.samples
    if samples.get(16, {}).get("head") and prof.model.get("vocab") != shape.vocab:
        log.warning(
            "profile for %s timed the LM head for vocabulary %s, not %s: the head comes from the roofline",
            name,
            prof.model.get("vocab"),
            shape.vocab,
        )
        samples = {**samples, 16: {k: v for k, v in samples[16].items() if k != "head"}}
    missing = [b for b in bits if b not in samples]
    if missing:
        log.warning("profile for %s lacks bits %s: those come from the roofline", name, missing)
        samples = {**samples, **roofline_profile(dev, shape, missing).samples}  # keeps the measured head
    return fit_profile(Profile(prof.device, prof.model, prof.source, samples, prof.meta), bits)


def quality_indicator(
    shape: ModelShape, bits: tuple[int, ...], path: str | Path | None = None, seed: int = 0
) -> dict[int, dict[int, float]]:
    if path is None:
        return synthetic_indicator(shape.config, list(bits), seed)
    p = Path(path)
    if not p.exists():
        raise ValueError(f"indicator file {p} not found")
    omega, meta = load_indicator(p)
    if len(omega) != shape.layers:
        raise ValueError(f"indicator {p} has {len(omega)} layers, model {shape.name} has {shape.layers}")
    for b in bits:
        if b != 16 and any(b not in v for v in omega.values()):
            raise ValueError(f"indicator {p} lacks {b}-bit values (has {meta.get('bits')})")
    for v in omega.values():
        v.setdefault(16, 0.0)
    return omega


def build_problem(
    cluster: Cluster,
    shape: ModelShape,
    workload: Workload,
    indicator: str | Path | None = None,
    profiles: Mapping[str, Profile] | None = None,
    seed: int = 0,
    head_split: bool = False,
    weights_only: bool = False,
) -> Problem:
    bits = tuple(sorted(workload.bits))
    return Problem(
        cluster,
        shape,
        workload,
        quality_indicator(shape, bits, indicator, seed),
        latency_models(cluster, shape, bits, profiles),
        head_split=head_split,
        weights_only=weights_only,
    )
