"""Latency cost model per device, bit width and phase (LLM-PQ's linear forms), fitted from profiles.

One decoder layer's time is

* prefill:  c0 + c1*v + c2*s + c3*v*s + c4*v*s^2     (v micro-batch size, s prompt length)
* decode:   d0 + d1*v + d2*v*c + d3*c                 (c = s + t tokens already in the cache)

fitted by non-negative least squares on relative error. A measured profile may also time the LM
head (final norm + ``hidden -> vocab`` projection of ``v`` tokens, at 16 bits): h0 + h1*v, fitted
the same way (``LatencyModel.head_coef``); without it the cost model uses the roofline
``lm_head_s``. A *profile* is a set of timed
samples per bit width: measured on the local device (``planner.profiler``) or derived from the
catalog by a roofline (``roofline_profile``) for devices that are not here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

import planfile.device_cost
from planner.catalog import DeviceType
from planner.modelshape import ModelShape
from quant import accounting

PROFILE_VERSION = 1
ROOFLINE_BATCHES = (1, 2, 4, 8, 16, 32)
ROOFLINE_LENGTHS = (64, 128, 256, 512, 1024, 2048)


def prefill_features(v: float, s: float) -> np.ndarray:
    return np.array(planfile.device_cost.prefill_features(v, s))


def decode_features(v: float, c: float) -> np.ndarray:
    return np.array(planfile.device_cost.decode_features(v, c))


def head_features(v: float) -> np.ndarray:
    return np.array(planfile.device_cost.head_features(v))


def fit_linear(rows: Sequence[np.ndarray], seconds: Sequence[float]) -> np.ndarray:
    """Non-negative coefficients minimising the squared *relative* error."""
    a = np.vstack(rows)
    y = np.asarray(seconds, dtype=float)
    if len(y) < a.shape[1]:
        raise ValueError(f"need at least {a.shape[1]} samples to fit, got {len(y)}")
    if np.any(y <= 0):
        raise ValueError("profile has non-positive timings")
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls((a / scale) / y[:, None], np.ones_like(y))
    return coef / scale


@dataclass
class Profile:
    """Timed samples of one decoder layer: ``samples[bits]["prefill"] = [(v, s, seconds)]``, ``["decode"] = [(v, c, seconds)]``.

    Optionally the LM head too: ``samples[16]["head"] = [(v, 0, seconds)]`` (``v`` tokens through the
    final norm and the ``hidden -> vocab`` projection), and ``samples[16]["driver"] = [(v, 0, seconds)]``
    (the engine's own work per decode micro-batch of ``v`` queries); profiles without them still load.
    """

    device: str
    model: dict
    source: str  # "measured" or "roofline"
    samples: dict[int, dict[str, list[tuple[float, float, float]]]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "version": PROFILE_VERSION,
            "device": self.device,
            "model": self.model,
            "source": self.source,
            "meta": self.meta,
            "samples": {
                str(b): {k: [list(r) for r in v] for k, v in ph.items()} for b, ph in self.samples.items()
            },
        }

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"profile version {d.get('version')!r} not supported (expected {PROFILE_VERSION})"
            )
        for k in ("device", "model", "samples"):
            if k not in d:
                raise ValueError(f"profile lacks {k!r}")
        samples = {
            int(b): {k: [tuple(map(float, r)) for r in rows] for k, rows in ph.items()}
            for b, ph in d["samples"].items()
        }
        for b, ph in samples.items():
            for phase in ("prefill", "decode"):
                if phase not in ph or not ph[phase]:
                    raise ValueError(f"profile has no {phase} samples for {b} bits")
            if any(len(r) != 3 for rows in ph.values() for r in rows):
                raise ValueError(f"profile samples at {b} bits must be (size, length, seconds) triples")
        return cls(d["device"], d["model"], d.get("source", "measured"), samples, d.get("meta", {}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"profile file {p} not found")
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"profile {p} is not JSON: {e}") from None


@dataclass(frozen=True)
class LatencyModel:
    """Fitted per-layer latency of one device type for one model shape, per bit width.

    ``head_coef`` (h0, h1): the measured LM head of ``v`` tokens takes h0 + h1*v seconds (fp16
    head, whatever the layers' bit widths); ``None`` when the profile did not time it.
    ``driver_coef`` (d0, d1): the engine's own work per decode micro-batch of ``v`` queries
    besides the model (scheduling, building and sending the batch, applying its tokens), which
    the first stage's process does; host CPU work, so a device's slowdown does not scale it.
    """

    device: str
    prefill_coef: dict[int, tuple[float, ...]]
    decode_coef: dict[int, tuple[float, ...]]
    head_coef: tuple[float, float] | None = None
    driver_coef: tuple[float, float] | None = None

    @property
    def bits(self) -> tuple[int, ...]:
        return tuple(sorted(self.prefill_coef))

    def prefill_s(self, bits: int, v: float, s: float) -> float:
        return float(np.dot(self.prefill_coef[bits], prefill_features(v, s)))

    def decode_s(self, bits: int, v: float, c: float) -> float:
        return float(np.dot(self.decode_coef[bits], decode_features(v, c)))

    def prefill_chunked_s(self, bits: int, v: float, s: float, chunks: int) -> float:
        """Whole prefill of ``v`` prompts of ``s`` tokens run as ``chunks`` chunks (SplitQuant's kappa).

        Conservative: the per-call terms (c0 + c1*v) are paid once per chunk, the token terms
        (c2*s + c3*v*s) once in all, and the attention term c4*v*s^2 in full (no saving is credited
        for a chunk attending only to the tokens before it). ``chunks == 1`` is ``prefill_s``.
        """
        c = self.prefill_coef[bits]
        return float(chunks * (c[0] + c[1] * v) + c[2] * s + c[3] * v * s + c[4] * v * s * s)

    def head_s(self, v: float) -> float | None:
        """Measured LM head of ``v`` tokens (seconds), or ``None`` when the profile had no head samples."""
        if self.head_coef is None:
            return None
        return float(np.dot(self.head_coef, head_features(v)))

    def driver_s(self, v: float) -> float:
        """The engine's own work per decode micro-batch of ``v`` queries (0 when not profiled)."""
        if self.driver_coef is None:
            return 0.0
        return max(0.0, float(np.dot(self.driver_coef, head_features(v))))

    def scaled(self, factor: float) -> LatencyModel:
        """Every time ``factor`` times as long (layers and the measured head; not the driver's host work)."""
        f = lambda d: {b: tuple(x * factor for x in c) for b, c in d.items()}  # noqa: E731
        head = None if self.head_coef is None else (self.head_coef[0] * factor, self.head_coef[1] * factor)
        return LatencyModel(self.device, f(self.prefill_coef), f(self.decode_coef), head, self.driver_coef)


def fit_head(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float] | None:
    """(h0, h1) of the LM head, or of the driver's work, from ``(v, 0, seconds)`` samples (time
    h0 + h1*v for ``v`` tokens or queries); ``None`` without samples.

    One batch size only: a constant (the mean), as nothing tells how the time grows with ``v``.
    """
    if not rows:
        return None
    if len({v for v, *_ in rows}) < 2:
        return (float(np.mean([t for *_, t in rows])), 0.0)
    c = fit_linear([head_features(v) for v, *_ in rows], [t for *_, t in rows])
    return (float(c[0]), float(c[1]))


def fit_profile(profile: Profile, bits: Iterable[int] | None = None) -> LatencyModel:
    """Fitted layer models at ``bits`` (default: the profile's), and the LM head if the profile timed it
    (at 16 bits, used whatever ``bits`` are)."""
    pre, dec = {}, {}
    for b in sorted(bits if bits is not None else profile.samples):
        if b not in profile.samples:
            raise ValueError(
                f"profile for {profile.device} has no samples at {b} bits (has {sorted(profile.samples)})"
            )
        ph = profile.samples[b]
        pre[b] = tuple(
            fit_linear([prefill_features(v, s) for v, s, _ in ph["prefill"]], [t for *_, t in ph["prefill"]])
        )
        dec[b] = tuple(
            fit_linear([decode_features(v, c) for v, c, _ in ph["decode"]], [t for *_, t in ph["decode"]])
        )
    head = fit_head(profile.samples.get(16, {}).get("head", []))
    driver = fit_head(profile.samples.get(16, {}).get("driver", []))
    return LatencyModel(profile.device, pre, dec, head, driver)


def _kernel_factor(dev: DeviceType, bits: int) -> float:
    """Compute slowdown of weight-only quantized kernels (dequantisation) at ``bits``."""
    if bits >= 16:
        return 1.0
    native = dev.int8 if bits == 8 else dev.int4
    return 1.15 if native else 1.6


def roofline_prefill_s(dev: DeviceType, shape: ModelShape, bits: int, v: float, s: float) -> float:
    p = shape.layer_params()
    attn_flops = 2 * 2 * v * s * s * shape.heads * shape.head_dim  # QK^T and AV, full (no causal skipping)
    flops = 2 * v * s * p * _kernel_factor(dev, bits) + attn_flops
    w = accounting.decoder_layer_weight_bytes(shape.config, bits)
    act = 2 * v * s * (4 * shape.hidden + shape.intermediate) * 2
    kv = v * s * accounting.kv_bytes_per_token(shape.config)
    t = max(
        flops / (dev.fp16_tflops * 1e12 * dev.compute_eff),
        (w + act + kv) / (dev.mem_bw_gbps * 1e9 * dev.mem_eff),
    )
    return t + dev.layer_overhead_s * (1.0 if bits >= 16 or _kernel_factor(dev, bits) < 1.5 else 1.3)


def roofline_decode_s(dev: DeviceType, shape: ModelShape, bits: int, v: float, c: float) -> float:
    p = shape.layer_params()
    flops = 2 * v * p * _kernel_factor(dev, bits) + 2 * 2 * v * c * shape.heads * shape.head_dim
    w = accounting.decoder_layer_weight_bytes(shape.config, bits)
    kv = v * c * accounting.kv_bytes_per_token(shape.config)
    t = max(
        flops / (dev.fp16_tflops * 1e12 * dev.compute_eff), (w + kv) / (dev.mem_bw_gbps * 1e9 * dev.mem_eff)
    )
    return t + dev.layer_overhead_s * (1.0 if bits >= 16 or _kernel_factor(dev, bits) < 1.5 else 1.3)


def roofline_profile(dev: DeviceType, shape: ModelShape, bits: Iterable[int]) -> Profile:
    """Samples over a (batch x length) grid from the catalog roofline, for devices not present here."""
    samples = {}
    for b in bits:
        pre = [
            (v, s, roofline_prefill_s(dev, shape, b, v, s))
            for v in ROOFLINE_BATCHES
            for s in ROOFLINE_LENGTHS
        ]
        dec = [
            (v, c, roofline_decode_s(dev, shape, b, v, c)) for v in ROOFLINE_BATCHES for c in ROOFLINE_LENGTHS
        ]
        samples[b] = {"prefill": pre, "decode": dec}
    return Profile(dev.name, shape.essentials(), "roofline", samples)


def lm_head_s(dev: DeviceType, shape: ModelShape, v: float) -> float:
    """One LM-head matmul (fp16) for ``v`` tokens, roofline."""
    flops = 2 * v * shape.hidden * shape.vocab
    w = shape.hidden * shape.vocab * 2
    return max(flops / (dev.fp16_tflops * 1e12 * dev.compute_eff), w / (dev.mem_bw_gbps * 1e9 * dev.mem_eff))


def paper_ratio_check(shape: ModelShape, p100: DeviceType, v100: DeviceType) -> dict[str, float]:
    """P100/V100 per-layer latency ratios from the fitted roofline models (LLM-PQ: 14.53x prefill, 7.29x decode)."""
    mp = fit_profile(roofline_profile(p100, shape, [16]))
    mv = fit_profile(roofline_profile(v100, shape, [16]))
    return {
        "prefill_ratio": mp.prefill_s(16, 8, 512) / mv.prefill_s(16, 8, 512),
        "decode_ratio": mp.decode_s(16, 8, 612) / mv.decode_s(16, 8, 612),
    }
