"""An emulated device's cost model as a plan carries it: seconds per decoder layer, bit width and phase.

A plan may give each device a ``cost`` (``plan.devices[i]["cost"]``): the planner's fitted
latency model of that device for the plan's model, the one it planned with. A pipeline stage
that emulates its device (``fleetbatch engine serve --plan P --device-cost plan``) makes each micro-batch
last what this model charges for the stage's layers at their bits, so the layout the planner
chose is what the run measures. The linear forms (LLM-PQ's) live here, at the bottom, and the
planner fits them (``planner.latency``):

* prefill of ``v`` prompts of ``s`` tokens, one layer:  c0 + c1*v + c2*s + c3*v*s + c4*v*s^2
* decode of ``v`` queries with ``c`` tokens of context:  d0 + d1*v + d2*v*c + d3*c
* the LM head over ``v`` rows (final norm and projection, 16 bits):  h0 + h1*v

``cost`` is ``{"prefill": {"16": [c0..c4], ...}, "decode": {"16": [d0..d3], ...}, "head": [h0, h1]
or null}`` with a key per bit width the plan may use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PREFILL_TERMS = 5
DECODE_TERMS = 4
HEAD_TERMS = 2


def prefill_features(v: float, s: float) -> tuple[float, ...]:
    return (1.0, v, s, v * s, v * s * s)


def decode_features(v: float, c: float) -> tuple[float, ...]:
    return (1.0, v, v * c, c)


def head_features(v: float) -> tuple[float, ...]:
    return (1.0, v)


def dot(coef: Sequence[float], features: Sequence[float]) -> float:
    return float(sum(a * x for a, x in zip(coef, features, strict=True)))


class DeviceCostError(ValueError):
    """A device cost that does not follow the schema."""


def _coefs(value: Any, n: int, where: str) -> tuple[float, ...]:
    ok = isinstance(value, (list, tuple)) and len(value) == n
    if ok:
        ok = all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
            for x in value
        )
    if not ok:
        raise DeviceCostError(f"{where} must be {n} finite numbers >= 0, got {value!r}")
    return tuple(float(x) for x in value)


@dataclass(frozen=True)
class DeviceCost:
    """Per-layer seconds of one device at each bit width it has coefficients for, and its LM head."""

    prefill: dict[int, tuple[float, ...]]
    decode: dict[int, tuple[float, ...]]
    head: tuple[float, float] | None = None

    @property
    def bits(self) -> tuple[int, ...]:
        return tuple(sorted(self.prefill))

    def prefill_s(self, bits: int, v: float, s: float) -> float:
        return dot(self._at(self.prefill, bits), prefill_features(v, s))

    def decode_s(self, bits: int, v: float, c: float) -> float:
        return dot(self._at(self.decode, bits), decode_features(v, c))

    def head_s(self, v: float) -> float:
        """The LM head over ``v`` rows; 0 when the device's model has no head term."""
        return 0.0 if self.head is None or v <= 0 else dot(self.head, head_features(v))

    def _at(self, table: dict[int, tuple[float, ...]], bits: int) -> tuple[float, ...]:
        if bits not in table:
            raise DeviceCostError(
                f"the device cost has no coefficients for {bits} bits (has {sorted(table)})"
            )
        return table[bits]

    def micro_batch_s(
        self,
        layer_bits: Sequence[int],
        prefill_tokens: Sequence[int],
        decode_contexts: Sequence[int],
        head_rows: float = 0.0,
    ) -> float:
        """Seconds this device takes for one micro-batch through layers of ``layer_bits``: prompt chunks
        of ``prefill_tokens`` tokens (one entry per prefilling query), decoding queries with
        ``decode_contexts`` tokens of context each, and ``head_rows`` rows of the LM head (a share of
        the sampled rows where the head is split). A chunk is charged as a prefill of its own tokens;
        the prefills of a micro-batch as ``v`` prompts of their mean length, the decodes at their mean
        context, as the planner's forms take them."""
        total = 0.0
        if prefill_tokens:
            v, s = len(prefill_tokens), sum(prefill_tokens) / len(prefill_tokens)
            total += sum(self.prefill_s(b, v, s) for b in layer_bits)
        if decode_contexts:
            v, c = len(decode_contexts), sum(decode_contexts) / len(decode_contexts)
            total += sum(self.decode_s(b, v, c) for b in layer_bits)
        return total + self.head_s(head_rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill": {str(b): list(c) for b, c in sorted(self.prefill.items())},
            "decode": {str(b): list(c) for b, c in sorted(self.decode.items())},
            "head": list(self.head) if self.head is not None else None,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "cost") -> DeviceCost:
        if not isinstance(d, dict):
            raise DeviceCostError(f"{where} must be an object with 'prefill', 'decode' and 'head'")
        tables = []
        for phase, n in (("prefill", PREFILL_TERMS), ("decode", DECODE_TERMS)):
            t = d.get(phase)
            if not isinstance(t, dict) or not t:
                raise DeviceCostError(f"{where}.{phase} must map bit widths to coefficients")
            try:
                tables.append({int(b): _coefs(c, n, f"{where}.{phase}[{b}]") for b, c in t.items()})
            except (TypeError, ValueError) as e:
                raise DeviceCostError(
                    str(e) if isinstance(e, DeviceCostError) else f"{where}.{phase}: {e}"
                ) from None
        if set(tables[0]) != set(tables[1]):
            raise DeviceCostError(f"{where}: prefill and decode cover different bit widths")
        head = d.get("head")
        h = None if head is None else _coefs(head, HEAD_TERMS, f"{where}.head")
        return cls(tables[0], tables[1], (h[0], h[1]) if h else None)
