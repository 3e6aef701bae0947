"""A stage that emulates its plan device by the device's cost model (``fleetbatch engine serve --device-cost plan``).

A plan's device may carry a ``cost`` (:class:`planfile.DeviceCost`: the planner's fitted
per-layer latency model). An :class:`EmulatedDevice` charges one micro-batch what that model
gives for the stage's layers at their plan bits, the micro-batch's prefill chunks (tokens per
prefilling query) and decode contexts (context length per decoding query), read from its
:class:`~engines.step_batch.StepBatch` layout, and the LM-head rows the stage computes (the last
stage: the sampled rows, less the first stage's share where the plan splits the head; the first
stage: that share; a one-stage plan: all of them). :class:`Hold` is the one rule every stage
follows, the driver's stage 0, the stage processes and a one-stage plan alike: after the real
compute, sleep until the micro-batch has lasted its charge; a micro-batch whose compute (wall
time) took longer lasts its compute and is an overrun (:class:`engines.device.DeviceClock`
counts it). The CPU still computes the real tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from engines.device import DeviceClock
from engines.interface import RequestOutput
from engines.step_batch import StepBatch
from planfile import DeviceCost


def batch_shape(batch: StepBatch) -> tuple[list[int], list[int]]:
    """``(prefill_tokens, decode_contexts)`` of a micro-batch: the tokens of each prompt chunk, and the
    context of each decoding query (its one new token included)."""
    prefill = [c.num_tokens for c in batch.chunks if not c.is_decode]
    decode = [c.start + 1 for c in batch.chunks if c.is_decode]
    return prefill, decode


def head_share(index: int, num_stages: int, first_share: float) -> float:
    """The share of the LM head's rows stage ``index`` computes, the first stage computing ``first_share``
    (the plan's head split) and the last the rest."""
    if num_stages == 1:
        return 1.0
    if index == 0:
        return first_share
    return 1.0 - first_share if index == num_stages - 1 else 0.0


@dataclass(frozen=True)
class EmulatedDevice:
    """One stage's device: its cost model, the bits of its layers, its share of the LM head."""

    cost: DeviceCost
    layer_bits: tuple[int, ...]
    head_share: float = 0.0

    @classmethod
    def for_stage(
        cls, cost: DeviceCost | None, layer_bits: tuple[int, ...], num_layers: int, share: float, where: str
    ) -> EmulatedDevice:
        """The device of a stage (``where`` names it in errors): a ValueError when its device has no
        cost, when the plan gives no bits for each of its ``num_layers`` layers, or when the cost has
        no coefficients for one of those bit widths."""
        if cost is None:
            raise ValueError(
                f"{where}: its plan device has no 'cost', so --device-cost plan cannot emulate it "
                "(plan with a device profile, or run without --device-cost)"
            )
        if len(layer_bits) != num_layers:
            raise ValueError(
                f"{where}: the plan gives bits for {len(layer_bits)} of its {num_layers} layers "
                "(a plan for another model?), so its device cost cannot be charged"
            )
        missing = sorted(set(layer_bits) - set(cost.bits))
        if missing:
            raise ValueError(f"{where}: its device cost has no coefficients for {missing} bits")
        return cls(cost, tuple(layer_bits), share)

    def layers_s(self, batch: StepBatch) -> float:
        """Seconds of the micro-batch through the stage's layers."""
        return self.cost.micro_batch_s(self.layer_bits, *batch_shape(batch))

    def head_s(self, batch: StepBatch) -> float:
        """Seconds of the stage's share of the LM head over the micro-batch's sampled rows."""
        return self.cost.head_s(len(batch.sample_rows) * self.head_share)

    def micro_batch_s(self, batch: StepBatch) -> float:
        """What the device takes for the micro-batch: its layers and its share of the head."""
        return self.cost.micro_batch_s(
            self.layer_bits, *batch_shape(batch), len(batch.sample_rows) * self.head_share
        )


@dataclass
class Hold:
    """One micro-batch on an emulated device, over the parts it is computed in (the first stage
    computes its layers when it sends the micro-batch on and its share of the head when it comes
    back): modelled seconds, and how long the parts lasted."""

    device_s: float = 0.0
    lasted_s: float = 0.0

    def part(self, device_s: float, started: float) -> float:
        """The part began at ``started`` (``time.perf_counter``) and its compute is done: sleep until it
        has lasted ``device_s`` (none if it already has: an overrun); returns the seconds slept."""
        wall = time.perf_counter() - started
        slept = 0.0
        if device_s > wall:
            time.sleep(device_s - wall)
            slept = time.perf_counter() - started - wall
        self.device_s += device_s
        self.lasted_s += max(wall, device_s)
        return slept

    def record(self, clock: DeviceClock) -> None:
        """Count the micro-batch: an overrun when a part outlasted its model (the clock's rule)."""
        clock.record(self.device_s, self.lasted_s)


def stamped(outputs: list[RequestOutput], step_start: float, end: float) -> list[RequestOutput]:
    """``outputs`` finished at ``end`` (epoch seconds), when the emulated device was done with them; a
    first token produced in the step (at or after ``step_start``) came at ``end`` too."""
    return [
        replace(
            o,
            finish_time=end,
            first_token_time=end if o.first_token_time >= step_start else o.first_token_time,
        )
        for o in outputs
    ]
