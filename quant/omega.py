"""The per-layer sensitivity indicator as numbers: its file (JSON) and the synthetic one the planner uses for models
too big to run here. No torch (:mod:`quant.indicator` measures one on a real model): the planner reads these.

The file format::

    {"model": ..., "bits": [3, 4, 8, 16], "omega": {"<layer>": {"<bits>": float}}, "meta": {...}}
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from collections.abc import Sequence
from typing import Any

from quant.accounting import layer_linear_shapes, max_code

log = logging.getLogger(__name__)

ERROR_MODELS = {"uniform": 1.0 / 12.0, "bound": 1.0 / 4.0}
DEFAULT_BITS = (3, 4, 8, 16)

Omega = dict[int, dict[int, float]]


def synthetic_indicator(
    config: Any,
    bits_list: Sequence[int] = DEFAULT_BITS,
    seed: int = 0,
    group_size: int | None = 128,
    symmetric: bool = True,
) -> Omega:
    """A *synthetic* (fabricated, plausible) omega for models too big to run here.

    Same formula, with ``D_W`` from the config's shapes, weights assumed Gaussian with std
    ``1/sqrt(in_features)`` (scale = expected max |w| of a group / max code) and an input second
    moment that grows with depth, is doubled for the first and last layers (commonly the most
    sensitive) and carries seeded log-normal noise. Not a measurement: for planner studies only.
    """
    rng = random.Random(seed)
    n_layers = int(config.num_hidden_layers)
    shapes = layer_linear_shapes(config)
    omega: Omega = {}
    for i in range(n_layers):
        depth = i / max(1, n_layers - 1)
        act = (1.0 + 2.0 * depth) * math.exp(rng.gauss(0.0, 0.3))
        if i in (0, n_layers - 1):
            act *= 2.0
        omega[i] = {}
        for b in bits_list:
            if b == 16:
                omega[i][b] = 0.0
                continue
            total = 0.0
            for _, fin, fout in shapes:
                gs = fin if group_size is None else min(group_size, fin)
                sigma = 1.0 / math.sqrt(fin)
                emax = sigma * math.sqrt(2.0 * math.log(2.0 * gs))  # ~ expected max |w| of gs Gaussians
                scale = (emax if symmetric else 2.0 * emax) / max_code(b, symmetric)
                total += fin * fout * scale**2 * ERROR_MODELS["uniform"] * act
            omega[i][b] = total
    return omega


def save_indicator(path: str | os.PathLike, omega: Omega, meta: dict) -> None:
    """Write omega as JSON: ``{"model", "bits", "omega": {"<layer>": {"<bits>": float}}, "meta"}``."""
    bits = sorted({b for v in omega.values() for b in v})
    doc = {
        "model": meta.get("model", "unknown"),
        "bits": bits,
        "omega": {str(i): {str(b): float(v[b]) for b in sorted(v)} for i, v in sorted(omega.items())},
        "meta": {k: v for k, v in meta.items() if k != "model"},
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    log.info("wrote the indicator of %d layers x %d bit widths to %s", len(omega), len(bits), path)


def load_indicator(path: str | os.PathLike) -> tuple[Omega, dict]:
    """Read a file written by :func:`save_indicator`: ``(omega {layer: {bits: value}}, meta)``."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a valid indicator file ({e.msg})") from e
    if not isinstance(doc, dict) or "omega" not in doc:
        raise ValueError(f"{path}: not an indicator file (no 'omega' key)")
    omega = {int(i): {int(b): float(x) for b, x in v.items()} for i, v in doc["omega"].items()}
    meta = dict(doc.get("meta", {}))
    meta["model"] = doc.get("model", "unknown")
    meta["bits"] = doc.get("bits", sorted({b for v in omega.values() for b in v}))
    return omega, meta
