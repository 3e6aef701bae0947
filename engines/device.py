"""An emulated device whose step time is a cost model of the work in the step.

One forward pass that computes ``p`` prefill tokens and decodes ``d`` sequences takes

    (step_overhead_s + prefill_per_token_s * p + decode_per_seq_s * d) / speed

seconds on the emulated device. ``fleetbatch engine serve --device-cost`` makes the worker sleep after each
step until the step has lasted what its forward passes cost (a step whose real compute took longer
lasts its compute, and counts as an overrun). Unlike ``--slowdown``, which multiplies each step's
own CPU time, the modelled time does not depend on how fast this CPU happens to run the step, on
what else runs on the machine, or on how much Python overhead a backend spends per step: the
static (Hugging Face ``generate``) and iteration-level backends are charged the same device for
the same work, as two engines on the same GPU would be. A static batch is charged for what a GPU
computes: every prompt padded to the longest, then every row decoding until the longest is done.

The same form is the simulator's cost model (:class:`sim.costs.LinearCost` extends this class), so
a real run under ``--device-cost`` and its simulation share one clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

#: one forward pass, as engines report it: (prefill tokens, decoded sequences, how many such passes)
Forward = tuple[int, int, int]


@dataclass(frozen=True)
class StepCost:
    """Seconds per forward pass on a speed-1 device, divided by ``speed``."""

    prefill_per_token_s: float = 0.0002
    decode_per_seq_s: float = 0.001
    step_overhead_s: float = 0.015
    speed: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prefill_per_token_s", "decode_per_seq_s", "step_overhead_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, not {v!r}")
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"speed must be a finite number > 0, not {self.speed!r}")
        if self.step_overhead_s + self.prefill_per_token_s + self.decode_per_seq_s <= 0:
            raise ValueError("a step must take some time: all cost terms are 0")

    def step_s(self, prefill_tokens: int, decode_seqs: int) -> float:
        """Seconds of one forward pass computing ``prefill_tokens`` prompt tokens and decoding ``decode_seqs`` queries."""
        return (
            self.step_overhead_s
            + self.prefill_per_token_s * prefill_tokens
            + self.decode_per_seq_s * decode_seqs
        ) / self.speed

    def forwards_s(self, forwards: Iterable[Forward]) -> float:
        """Seconds of a step's forward passes, ``(prefill tokens, decoded sequences, repeats)`` each."""
        return sum(self.step_s(p, d) * n for p, d, n in forwards)

    @classmethod
    def parse(cls, text: str, speed: float = 1.0) -> StepCost:
        """``"OVERHEAD_MS,PREFILL_MS_PER_TOKEN,DECODE_MS_PER_SEQ"`` (milliseconds) -> a cost at ``speed``."""
        parts = [x.strip() for x in text.split(",")]
        if len(parts) != 3:
            raise ValueError(
                f"a device cost is three comma-separated milliseconds: step overhead, per prefill "
                f"token, per decoded sequence (e.g. 8,0.05,0.5), not {text!r}"
            )
        try:
            overhead, prefill, decode = (float(x) / 1000.0 for x in parts)
        except ValueError:
            raise ValueError(f"device cost terms must be numbers (milliseconds), not {text!r}") from None
        return cls(
            prefill_per_token_s=prefill, decode_per_seq_s=decode, step_overhead_s=overhead, speed=speed
        )

    def describe(self) -> str:
        return (
            f"{self.step_overhead_s * 1e3:g} ms + {self.prefill_per_token_s * 1e3:g} ms/prefill token + "
            f"{self.decode_per_seq_s * 1e3:g} ms/decoded query per step"
            + (f", / {self.speed:g}" if self.speed != 1 else "")
        )


@dataclass
class DeviceClock:
    """What the emulated device of ``--device-cost`` did: steps, modelled seconds, and the steps whose
    real compute outlasted the model (those last their compute: the emulation is then too fast)."""

    steps: int = 0
    device_s: float = 0.0
    overrun_steps: int = 0
    overrun_s: float = 0.0

    def record(self, device_s: float, compute_s: float) -> None:
        self.steps += 1
        self.device_s += device_s
        if compute_s > device_s:
            self.overrun_steps += 1
            self.overrun_s += compute_s - device_s

    def describe(self) -> str:
        return (
            f"{self.steps} steps, {self.device_s:.1f} s modelled; {self.overrun_steps} steps "
            f"({self.overrun_steps / max(self.steps, 1):.1%}) outlasted the model by {self.overrun_s:.2f} s in all"
        )
