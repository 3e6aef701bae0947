"""A planned cluster's engine in cost-model time: the native engine running a plan's pipeline stages.

:class:`PipelinedEngine` is :class:`sim.engines.IterationEngine` (the real scheduler, KV cache
and ``free_slots``) with the plan applied as :func:`engines.plan.apply_plan` applies it
(``max_running`` = decode micro-batch x stages, at most ``decode_micro_batch`` decoding and
``prefill_micro_batch`` prefilling queries per micro-batch) and :meth:`LLMEngine.step`'s loop:
schedule micro-batches of queries not in flight (``Scheduler.schedule(busy)``) until one per
stage is in flight, then take the oldest back and apply it.

Each micro-batch lasts on each stage what that stage's plan device charges
(:class:`engines.emulation.EmulatedDevice`, built by :meth:`engines.stage_spec.StageSpec.emulated`
from :func:`engines.plan.plan_stages`, as ``fleetbatch engine serve --device-cost plan`` builds it), read
from the micro-batch's layout (prompt chunk tokens, decode contexts, sampled rows). The timing
follows :mod:`engines.pipeline`: the driver computes stage 0's layers when it submits (it waits
for them), the stage processes take micro-batches in order, each when it arrives and the stage
is free, and the driver, waiting for the oldest to come back from the last stage, then computes
its share of the LM head (the plan's ``head_split``). A one-stage plan charges the whole
micro-batch, head included, before the update. Host work (scheduling, sampling, Redis) takes
no time here.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from engines.config import EngineConfig
from engines.emulation import EmulatedDevice
from engines.plan import apply_plan, plan_stages
from engines.scheduler import SchedulerOutput
from engines.step_batch import ChunkLayout
from planfile import load_plan
from sim.costs import LinearCost
from sim.engines import IterationEngine
from sim.workload import Workload


@dataclass(frozen=True)
class Layout:
    """What an :class:`EmulatedDevice` reads of a micro-batch (a :class:`engines.step_batch.StepBatch`'s
    ``chunks`` and ``sample_rows``), without the index tensors."""

    chunks: list[ChunkLayout]
    sample_rows: range

    @classmethod
    def of(cls, plan: SchedulerOutput) -> Layout:
        chunks = [ChunkLayout(c.start, c.num_tokens, c.samples, ()) for c in plan.chunks]
        return cls(chunks, range(sum(c.samples for c in chunks)))


class PipelineClock:
    """When a micro-batch leaves each stage of a pipeline of emulated devices (stage 0: the driver)."""

    def __init__(self, devices: list[EmulatedDevice]) -> None:
        if not devices:
            raise ValueError("a pipeline needs at least one stage")
        self.devices = devices
        self.free = [0.0] * len(devices)  # when each stage process is done with its last micro-batch

    def submit(self, t: float, batch: Layout) -> tuple[float, float]:
        """The driver submits ``batch`` at ``t``: ``(when the driver is free again, when the last stage
        is done with it)``."""
        first, rest = self.devices[0], self.devices[1:]
        if not rest:  # one stage: the whole micro-batch, head included, in the driver
            end = t + first.micro_batch_s(batch)
            return end, end
        t += first.layers_s(batch)
        driver = t
        for k, dev in enumerate(rest, start=1):
            t = max(t, self.free[k]) + dev.micro_batch_s(batch)
            self.free[k] = t
        return driver, t

    def head_s(self, batch: Layout) -> float:
        """The driver's share of the LM head, computed when the micro-batch is back (0 for one stage)."""
        return self.devices[0].head_s(batch) if len(self.devices) > 1 else 0.0

    @classmethod
    def from_plan(cls, path: str | Path) -> PipelineClock:
        """The devices ``fleetbatch engine serve --plan PATH --device-cost plan`` emulates (a ValueError when a
        stage's device has no cost model)."""
        plan = load_plan(Path(path))
        stages = plan_stages(str(path))
        n = len(stages)
        if n == 1:
            return cls([stages[0].emulated(1, 0.0)])
        vocab = int(plan.model.get("vocab") or 0)
        share = round(plan.head_split * vocab) / vocab if vocab else plan.head_split  # PipelineRunner's rows
        return cls([s.emulated(n, share) for s in stages])


class PipelinedEngine(IterationEngine):
    """The native engine with a plan, its stages on their plan devices' cost models (module docstring)."""

    def __init__(
        self, plan_path: str | Path, config: EngineConfig, work: Workload, max_tokens: int = 256
    ) -> None:
        config = copy.deepcopy(config)
        config.plan_path = str(plan_path)
        apply_plan(config)
        super().__init__(config, LinearCost(), work, max_tokens, bulk=False)  # the cost is the plan's
        self.clock = PipelineClock.from_plan(plan_path)
        self.num_stages = len(self.clock.devices)
        self.predicted_tokens_per_s = float(load_plan(Path(plan_path)).predicted_throughput_tokens_per_s)
        self._inflight: deque[tuple[SchedulerOutput, float, Layout]] = deque()
        self._busy: set[str] = set()
        self._t = 0.0  # the driver's clock (only differences count: nothing is in flight while idle)

    def start_step(self) -> float | None:
        """One ``LLMEngine.step``: submit micro-batches until one per stage is in flight, take the oldest
        back; the seconds until its update, or None when there is nothing to run."""
        sched, t = self.scheduler, self._t
        while len(self._inflight) < self.num_stages:
            plan = sched.schedule(self._busy)
            self._account(plan)
            if not plan.chunks:
                break
            batch = Layout.of(plan)
            t, done_at = self.clock.submit(t, batch)
            self._inflight.append((plan, done_at, batch))
            self._busy.update(c.seq.request_id for c in plan.chunks)
        if not self._inflight:
            self._plan = None
            return None
        self._kv_step = self.kv.used_blocks * self.kv.block_size
        plan, done_at, batch = self._inflight.popleft()
        self._busy.difference_update(c.seq.request_id for c in plan.chunks)
        t = max(t, done_at) + self.clock.head_s(batch)
        self._plan = plan
        self._dt, self._t = t - self._t, t
        return self._dt
