"""One stage of a plan as the engine runs it: its layers, its device (slowdown, memory cap, cost model)."""

from __future__ import annotations

from dataclasses import dataclass

from engines.emulation import EmulatedDevice, head_share
from planfile import DeviceCost


@dataclass(frozen=True)
class StageSpec:
    """One stage of a plan as the engine runs it."""

    index: int
    layer_start: int
    layer_end: int
    slowdown: float = 0.0
    memory_bytes: int | None = None  # the device's memory cap (None: no cap)
    device_name: str = ""
    predicted_prefill_s: float = 0.0
    predicted_decode_s: float = 0.0
    cost: DeviceCost | None = None  # the device's cost model, when the plan gives one
    layer_bits: tuple[int, ...] = ()  # the plan's bits of the stage's layers

    def describe(self) -> str:
        dev = f" on {self.device_name}" if self.device_name else ""
        return f"stage {self.index} (layers [{self.layer_start}, {self.layer_end}){dev})"

    def emulated(self, num_stages: int, first_head_share: float) -> EmulatedDevice:
        """The stage's device as ``--device-cost plan`` emulates it, in a pipeline of ``num_stages``
        whose first stage computes ``first_head_share`` of the LM head; a ValueError naming the
        stage when its device cannot be emulated."""
        share = head_share(self.index, num_stages, first_head_share)
        n = self.layer_end - self.layer_start
        return EmulatedDevice.for_stage(self.cost, self.layer_bits, n, share, self.describe())
