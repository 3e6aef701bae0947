"""The driver's side of a multi-stage plan: stage 0 in this process, one process per further stage.

The driver (rank 0) owns the scheduler, embeds, runs stage 0's layers, and samples; stages 1..S-1 are
processes of their own (:mod:`engines.stage_worker`, started and watched by :mod:`engines.stage_procs`)
holding only their own layers and their layers' paged KV pools. ``submit`` runs stage 0 on a micro-batch
and sends it on without waiting; ``result`` receives the logits of the oldest micro-batch in flight from
the last stage, or, for a greedy micro-batch, the tokens the last stage picked. With a head split (the
plan's ``head_split``, ``planner.head_split``) the driver computes the LM head's first rows itself from
the final hidden states the last stage sends back with the logits of the other rows, so a head-heavy
last stage is balanced against the first. The engine keeps up to ``num_stages`` micro-batches in flight,
so every stage works at once. KV blocks are numbered by the driver's block manager and mean the same
slots in every stage, so freeing a finished query's blocks frees them in every stage at once.

A watchdog notices a stage process that dies, names it, and stops the others; the blocked
call then raises :class:`StageFailure` with that name.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
import weakref
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from engines.emulation import Hold
from engines.interface import EngineFailure
from engines.model_runner import ModelRunner
from engines.stage_model import cut_stage, head_rows, hidden_size, model_dtype, module_bytes, vocab_size
from engines.stage_procs import StageWatch, kill_stages, stage_context, stop_stages
from engines.stage_spec import StageSpec
from engines.stage_wire import GREEDY, STEP, STOP, Inbox, Outbox, capacity, pack, unpack
from engines.stage_worker import (
    COUNTERS,
    NUM_COUNTERS,
    StageArgs,
    StageCounters,
    backend_for,
    emulate,
    stage_main,
    timed,
)
from engines.step_batch import StepBatch

log = logging.getLogger(__name__)


#: how long a blocked send or receive may wait once the pipeline runs: an idle engine waits for
#: work indefinitely, and a dead stage is found by the watchdog, not by a timeout
SESSION_TIMEOUT = timedelta(days=365)


def greedy_of_parts(first: torch.Tensor, rest_best: torch.Tensor, rest_tokens: torch.Tensor) -> torch.Tensor:
    """``argmax`` over the whole vocabulary from the logits of its first rows ``first`` ``[n, k]`` and,
    for the rest, each row's largest logit ``rest_best`` ``[n]`` and its index ``rest_tokens``:
    the first largest, a NaN counting as the largest (as ``argmax``)."""
    mine = first.max(dim=-1)
    wins = (rest_best > mine.values) | (rest_best.isnan() & ~mine.values.isnan())
    return torch.where(wins, rest_tokens, mine.indices)


class StageFailure(EngineFailure):
    """A pipeline stage process died or could not start; the message names the stage."""


def free_port() -> int:
    """A free port for the rendezvous, below the kernel's ephemeral range: a port from ``bind(0)`` is free
    again once tested, and another process binding port 0 (a server, a stage, another pipeline) could take
    it before the driver's store does; its stages then joined a stranger's store and hung (seen once)."""
    for _ in range(100):
        port = random.SystemRandom().randint(20000, 32000)  # the ephemeral range: 32768-60999 by default
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PipelineRunner:
    """Runs a plan's stages: stage 0 here, the rest in processes of their own linked by ``torch.distributed``."""

    def __init__(
        self,
        model: nn.Module,
        stages: list[StageSpec],
        num_blocks: int,
        block_size: int,
        kv_bits: int = 16,
        init_method: str | None = None,
        backend: str = "auto",
        device: str = "cpu",
        start_timeout_s: float = 120.0,
        max_tokens: int = 512,
        max_sampled: int = 64,
        head_split: float = 0.0,
        emulate_cost: bool = False,
    ) -> None:
        if len(stages) < 2:
            raise ValueError("a pipeline needs at least 2 stages (one stage runs in-process)")
        if device != "cpu":
            raise ValueError(
                f"pipeline stages on {device!r} are not supported yet: the stage processes run on the "
                "CPU (one-stage engines take a device; the NCCL backend is picked for CUDA stages)"
            )
        self.stages = stages
        self.num_stages = len(stages)
        self.device = device
        self.vocab = vocab_size(model)
        self.dtype = model_dtype(model)
        if not 0 <= head_split <= 1:
            raise ValueError(f"head_split must be from 0 to 1, got {head_split}")
        self.head_start = round(head_split * self.vocab)  # the driver computes LM-head rows [0, head_start)
        self.head0 = head_rows(model, 0, self.head_start) if self.head_start else None
        self.hidden = hidden_size(model)
        self.model_module = type(model).__module__  # its layers' classes: a stage server it starts imports them
        # --device-cost plan: every stage's device by its cost model (ValueError naming a stage that has none)
        share = self.head_start / self.vocab
        self.emulated = [s.emulated(self.num_stages, share) if emulate_cost else None for s in stages]
        s0 = stages[0]
        self.stage0 = ModelRunner(model, num_blocks, block_size, kv_bits, range(s0.layer_start, s0.layer_end))
        parts = [
            cut_stage(model, s.layer_start, s.layer_end, s.index == 0, s is stages[-1], self.head_start)
            for s in stages
        ]
        if self.head0 is not None:
            parts[0] = nn.ModuleList([parts[0], self.head0])  # for the memory count (shared rows once)
        self.memory = self._check_memory(parts)
        self.counters = StageCounters(memory_bytes=self.memory[0])
        self.trailer = torch.zeros(self.num_stages, NUM_COUNTERS, dtype=torch.float64)
        self._watch: StageWatch | None = None
        self._inflight: deque[tuple[StepBatch, Hold]] = deque()
        init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
        backend = backend_for(device, backend)
        layout_cap = 2 + 4 * max_tokens + num_blocks  # the blocks of one micro-batch's queries are distinct
        self.procs: list = []
        try:
            conns = self._spawn(
                parts, init_method, backend, num_blocks, block_size, kv_bits, max_tokens, layout_cap
            )
            self._wait_ready(conns, start_timeout_s)
            dist.init_process_group(
                backend, init_method=init_method, rank=0, world_size=self.num_stages, timeout=SESSION_TIMEOUT
            )
            S = self.num_stages
            self.outbox = Outbox(1)
            logits_cols = self.vocab - self.head_start + (self.hidden if self.head_start else 0)
            cols = max(logits_cols, self.hidden + 1)  # logits, or a greedy reply's hidden | best
            self.inbox = Inbox(
                S - 1, capacity(max_sampled, S, NUM_COUNTERS, max_sampled, cols, self.dtype), S
            )
            self._watch = StageWatch([s.describe() for s in stages[1:]], self.procs)
        except BaseException:
            kill_stages(self.procs)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        self._finalizer = weakref.finalize(
            self, stop_stages, self._watch, self.procs
        )  # freed without close()
        log.info(
            "pipeline of %d stages (%s): %s; stage pids %s",
            self.num_stages,
            backend,
            ", ".join(s.describe() + self._emulation(s) for s in stages),
            [p.pid for p in self.procs],
        )

    def _emulation(self, s: StageSpec) -> str:
        if self.emulated[s.index] is not None:
            return " emulated by its cost model"
        return f" x{1 + s.slowdown:g} slower" if s.slowdown else ""

    def _check_memory(self, parts: list[nn.Module]) -> list[int]:
        """Bytes of every stage (its weights + its layers' KV pools); a stage over its device's cap is an error."""
        s0 = self.stages[0]
        per_layer_kv = self.stage0.kv_pool_bytes() // (s0.layer_end - s0.layer_start)
        memory = []
        for s, part in zip(self.stages, parts, strict=True):
            need = module_bytes(part) + per_layer_kv * (s.layer_end - s.layer_start)
            if s.memory_bytes is not None and need > s.memory_bytes:
                raise ValueError(
                    f"{s.describe()} needs {need / 2**20:.1f} MiB (weights + KV cache) but its device "
                    f"caps memory at {s.memory_bytes / 2**20:.1f} MiB"
                )
            memory.append(need)
        return memory

    def _spawn(
        self, parts, init_method, backend, num_blocks, block_size, kv_bits, max_tokens, layout_cap
    ) -> list:
        """Start one process per stage after the first; returns the pipes they report readiness on."""
        conns = []
        for s, part in zip(self.stages[1:], parts[1:], strict=True):
            ctx = stage_context(part, self.model_module)
            parent, child = ctx.Pipe()
            args = StageArgs(
                s.index,
                self.num_stages,
                init_method,
                backend,
                self.device,
                part,
                s.layer_start,
                s.layer_end,
                num_blocks,
                block_size,
                kv_bits,
                s.slowdown,
                self.memory[s.index],
                torch.get_num_threads(),
                os.getpid(),
                max_tokens,
                layout_cap,
                self.head_start if s is self.stages[-1] else 0,
                self.vocab,
                self.emulated[s.index],
            )
            p = ctx.Process(
                target=stage_main, args=(args, child), name=f"fleetbatch-stage{s.index}", daemon=True
            )
            try:
                p.start()
            except (OSError, EOFError, ValueError) as e:  # e.g. the fork server could not start
                raise StageFailure(f"{s.describe()} could not start: {type(e).__name__}: {e}") from e
            self.procs.append(p)
            conns.append(parent)
        return conns

    # ---- start and faults ---------------------------------------------------------------
    def _wait_ready(self, conns: list, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for s, p, conn in zip(self.stages[1:], self.procs, conns, strict=True):
            while not conn.poll(0.1):
                if not p.is_alive():
                    raise StageFailure(f"{s.describe()} exited while starting (exit code {p.exitcode})")
                if time.monotonic() > deadline:
                    raise StageFailure(f"{s.describe()} did not start within {timeout_s:.0f} s")
            status, detail = conn.recv()
            if status != "ready":
                raise StageFailure(f"{s.describe()} could not start: {detail}")

    @property
    def stage_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def failure(self) -> str | None:
        """The stage that died, named, once the watchdog found it (``None`` while every stage runs)."""
        return self._watch.failure if self._watch is not None else None

    def _fail(self, e: Exception) -> StageFailure:
        self._watch.found.wait(2.0)  # let the watchdog name the stage (a receive can fail first)
        return StageFailure(f"pipeline stopped: {self.failure or e}")

    # ---- micro-batches --------------------------------------------------------------------
    def submit(self, batch: StepBatch, greedy: bool = False) -> None:
        """Run stage 0 on ``batch`` (embedding and its layers) and send it to stage 1. ``greedy``: every
        query sampled in it decodes greedily, so the last stage picks the tokens (vLLM samples on
        the last pipeline rank too) and only token ids come back instead of logits."""
        if self.failure:
            raise StageFailure(f"pipeline stopped: {self.failure}")

        def compute():
            with torch.inference_mode():
                return self.stage0.forward(self.stage0.embed(batch), batch)

        hold, started = Hold(), time.perf_counter()
        h, compute_s = timed(compute, self.device)
        self.counters.record(batch, compute_s, self._emulate(batch, hold, started, compute_s, head=False))
        self.trailer[0] = self.counters.row()
        try:
            self.outbox.send(pack(STEP, batch.to_tensor(), self.trailer, h, GREEDY if greedy else 0))
        except RuntimeError as e:
            raise self._fail(e) from e
        self._inflight.append((batch, hold))

    def result(self) -> torch.Tensor | list[int]:
        """The oldest micro-batch in flight: the logits ``[n_sampled, vocab]`` of its sampled rows,
        or, if it was submitted ``greedy``, their tokens."""
        batch, hold = self._inflight.popleft()
        t0 = time.perf_counter()
        try:
            buf = self.inbox.get()
        except RuntimeError as e:
            raise self._fail(e) from e
        self.counters.values["idle_s"] += time.perf_counter() - t0
        msg = unpack(buf, self.num_stages, NUM_COUNTERS, self.dtype)
        if msg.flags & GREEDY:
            out = self._greedy(batch, hold, msg.layout, msg.payload)
        elif self.head0 is None:
            out = msg.payload.to(self.device, copy=True)
        else:
            out = self._head_rows(batch, hold, msg.payload.to(self.device))
        if self.emulated[0] is not None and self.emulated[0].head_share > 0:
            hold.record(self.counters.clock)  # its layers when sent, its share of the head now
        self.trailer = msg.counters.clone()
        self.trailer[0] = self.counters.row()
        self.inbox.release()
        return out

    def _emulate(self, batch: StepBatch, hold: Hold, started: float, compute_s: float, head: bool) -> float:
        """Stage 0's device after computing its layers (``head`` False) or its share of the LM head:
        the seconds slept, by the plan device's cost model or by the device's ``slowdown``."""
        dev = self.emulated[0]
        if dev is None:
            return emulate(self.stages[0].slowdown, compute_s)
        device_s = dev.head_s(batch) if head else dev.layers_s(batch)
        if head and device_s <= 0:  # no rows, or a model with no head term: uncharged, as sampling is
            return 0.0
        slept = hold.part(device_s, started)
        if not head and dev.head_share <= 0:
            hold.record(self.counters.clock)  # no head here: the micro-batch is done with this stage
        return slept

    def _head(self, batch: StepBatch, hold: Hold, fn):
        """``fn()``, this stage's share of the LM head, timed and counted as its compute."""

        def compute():
            with torch.inference_mode():
                return fn()

        started = time.perf_counter()
        out, compute_s = timed(compute, self.device)
        self.counters.add(batch, compute_s, self._emulate(batch, hold, started, compute_s, head=True))
        return out

    def _head_rows(self, batch: StepBatch, hold: Hold, payload: torch.Tensor) -> torch.Tensor:
        """The whole logits from the last stage's ``[final hidden | its rows' logits]``: this stage's rows first."""
        x, rest = payload[:, : self.hidden], payload[:, self.hidden :]
        return self._head(batch, hold, lambda: torch.cat([self.head0(x), rest], dim=1))

    def _greedy(self, batch: StepBatch, hold: Hold, tokens: torch.Tensor, payload: torch.Tensor) -> list[int]:
        """A greedy micro-batch's tokens: the last stage's, or, with a head split, whichever of its
        best and this stage's best is larger (ties to the lower index, as ``argmax`` over all rows)."""
        if self.head0 is None or not batch.sample_rows:
            return tokens.tolist()
        x = payload[:, : self.hidden].to(self.device)

        def pick() -> torch.Tensor:
            mine = self.head0(x)
            if self.head_start >= self.vocab:
                return mine.max(dim=-1).indices
            return greedy_of_parts(mine, payload[:, self.hidden].to(self.device), tokens.to(self.device))

        return self._head(batch, hold, pick).tolist()

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def stage_counters(self) -> list[dict[str, float]]:
        """The latest counters of every stage (cumulative), as of the last micro-batch that came back."""
        rows = self.trailer.tolist()
        rows[0] = self.counters.row().tolist()
        return [dict(zip(COUNTERS, r, strict=True)) for r in rows]

    def close(self) -> None:
        """Stop every stage (they exit on ``STOP``; stragglers are killed) and leave the process group."""
        if self._watch is None or self._watch.stopped:
            return
        self._watch.stop()  # first: stages that exit from here on are not failures
        if self.failure is None:
            try:
                self.outbox.send(pack(STOP, torch.zeros(0, dtype=torch.long), self.trailer, None))
                self.outbox.flush()
            except RuntimeError:
                pass
            for p in self.procs:
                p.join(timeout=10)
        kill_stages(self.procs)
        # the receives still posted hold the process group: dropped first, so that it is torn down here and
        # not at the interpreter's exit
        self.inbox = self.outbox = None
        if dist.is_initialized():
            dist.destroy_process_group()
