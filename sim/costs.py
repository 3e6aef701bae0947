"""Step times in cost-model seconds: a linear per-cluster model, or one linearised from a fleetbatch planner profile.

One engine step that computes ``p`` prefill tokens and decodes ``d`` sequences takes

    (step_overhead_s + prefill_per_token_s * p + decode_per_seq_s * d) / speed

seconds. ``speed`` is the cluster's speed factor (1:2:4 fleets). The model has no context-length
term on purpose: a step's time then does not change while a batch decodes, so the simulator can
advance many identical decode steps at once (``docs/design/sim.md``). :meth:`LinearCost.from_profile`
linearises a fleetbatch planner profile (``fleetbatch planner profile`` / ``fleetbatch engine profile`` output, the LLM-PQ forms of
``docs/design/planner.md``) at a reference prompt length and context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from engines.device import StepCost
from planner.latency import Profile, fit_profile


@dataclass(frozen=True)
class LinearCost(StepCost):
    """Per-cluster step cost (:class:`engines.device.StepCost`, the emulated device of ``fleetbatch engine serve
    --device-cost``); times are those of a speed-1 cluster, divided by ``speed``."""

    def with_speed(self, speed: float) -> LinearCost:
        return replace(self, speed=speed)

    def tokens_per_s(self, batch: int, prompt_tokens: float, response_tokens: float) -> float:
        """Prompt + response tokens per second of a full batch of mean-sized queries (the capacity hint
        the gateway's token policy and offloader are given, as ``capacity_hint_tps`` in a real fleet)."""
        per_query = (
            self.prefill_per_token_s * prompt_tokens
            + response_tokens * (self.step_overhead_s / batch + self.decode_per_seq_s)
        ) / self.speed
        return (prompt_tokens + response_tokens) / max(per_query, 1e-12)

    @classmethod
    def from_profile(
        cls,
        path: str | Path,
        layers: int,
        bits: int = 16,
        prompt_ref: float = 128.0,
        context_ref: float = 256.0,
        speed: float = 1.0,
    ) -> LinearCost:
        """Linearise a fleetbatch planner profile of one decoder layer for a ``layers``-layer model on one device.

        Prefill of a chunk of ``s`` tokens: ``c0 + c1 + (c2 + c3) s + c4 s^2`` per layer, taken per
        token at ``s = prompt_ref`` (the per-call terms go to the step overhead). Decode of ``v``
        sequences at context ``c``: ``d0 + d1 v + d2 v c + d3 c`` per layer at ``c = context_ref``.
        The LM head, when the profile timed it (``h0 + h1 v``), adds to the overhead and per sequence.
        """
        if layers < 1:
            raise ValueError(f"layers must be >= 1, not {layers}")
        model = fit_profile(Profile.load(path))
        if bits not in model.prefill_coef:
            raise ValueError(f"profile {path} has no fit at {bits} bits (has {list(model.bits)})")
        c0, c1, c2, c3, c4 = map(float, model.prefill_coef[bits])
        d0, d1, d2, d3 = map(float, model.decode_coef[bits])
        h0, h1 = map(float, model.head_coef or (0.0, 0.0))
        return cls(
            prefill_per_token_s=layers * (c2 + c3 + c4 * prompt_ref),
            decode_per_seq_s=layers * (d1 + d2 * context_ref) + h1,
            step_overhead_s=layers * (c0 + c1 + d0 + d3 * context_ref) + h0,
            speed=speed,
        )


def parse_speeds(text: str) -> list[float]:
    """``"1,2,4"`` -> ``[1.0, 2.0, 4.0]``; every speed must be > 0."""
    try:
        speeds = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"speeds must be comma-separated numbers, not {text!r}") from None
    if not speeds or any(not (math.isfinite(s) and s > 0) for s in speeds):
        raise ValueError(f"speeds must be positive numbers, not {text!r}")
    return speeds
