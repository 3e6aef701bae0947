"""The process of one pipeline stage after the first: receive a micro-batch, run its layers, pass it on.

Messages (:mod:`engines.stage_wire`) go down the chain 0 -> 1 -> ... -> S-1 by
``torch.distributed`` point-to-point, FIFO per pair; each carries the micro-batch layout, the
hidden states and the per-stage counters (each stage fills in its own row). The last stage
computes the logits of the sampled rows and sends them, with the counters, back to rank 0 (the
driver); for a micro-batch flagged ``GREEDY`` it picks the tokens itself and sends back their
ids instead. ``STOP`` travels down the chain and every stage exits.

A stage exits by itself when its driver disappears (a pidfd watch: its parent is the fork server), so
no orphan outlives a killed engine.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from engines.device import DeviceClock
from engines.emulation import EmulatedDevice, Hold
from engines.model_runner import ModelRunner
from engines.stage_model import hidden_size, model_dtype
from engines.stage_wire import GREEDY, STEP, STOP, Inbox, Outbox, capacity, pack, unpack
from engines.step_batch import StepBatch
from workqueue.embedded import on_exit_of

log = logging.getLogger(__name__)

#: per-stage counters, cumulative since the stage started (one row per stage in the trailer)
COUNTERS = (
    "micro_batches",
    "compute_s",  # CPU time of the stage's thread (wall time with a CUDA sync on GPU)
    "sleep_s",  # emulated extra time of a slower device
    "idle_s",  # waiting for the previous stage (or, on rank 0, for results)
    "decode_micro_batches",
    "decode_latency_s",  # compute + sleep of decode-only micro-batches
    "decode_rows",
    "memory_bytes",  # weights + KV pools of the stage
    # --device-cost plan (engines.emulation): micro-batches charged by the device's cost model, their
    # modelled seconds, and those whose compute outlasted the model (and by how much)
    "device_steps",
    "device_s",
    "device_overrun_steps",
    "device_overrun_s",
)
NUM_COUNTERS = len(COUNTERS)


@dataclass
class StageCounters:
    """The counters one stage keeps; ``row()`` is its row of the trailer."""

    memory_bytes: int = 0
    values: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    clock: DeviceClock = field(default_factory=DeviceClock)  # the emulated device's micro-batches

    def record(self, batch: StepBatch, compute_s: float, sleep_s: float) -> None:
        """One micro-batch through this stage."""
        v = self.values
        v["micro_batches"] += 1
        if batch.is_decode_only:
            v["decode_micro_batches"] += 1
            v["decode_rows"] += batch.num_decode
        self.add(batch, compute_s, sleep_s)

    def add(self, batch: StepBatch, compute_s: float, sleep_s: float) -> None:
        """Work on a micro-batch (more of it, for the first stage's share of the LM head)."""
        v = self.values
        v["compute_s"] += compute_s
        v["sleep_s"] += sleep_s
        if batch.is_decode_only:
            v["decode_latency_s"] += compute_s + sleep_s

    def row(self) -> torch.Tensor:
        v, c = self.values, self.clock
        v["memory_bytes"] = float(self.memory_bytes)
        v["device_steps"], v["device_s"] = float(c.steps), c.device_s
        v["device_overrun_steps"], v["device_overrun_s"] = float(c.overrun_steps), c.overrun_s
        return torch.tensor([self.values[k] for k in COUNTERS], dtype=torch.float64)


def backend_for(device: str, backend: str = "auto") -> str:
    """NCCL for CUDA devices, gloo on CPU, unless named."""
    if backend != "auto":
        return backend
    return "nccl" if device.startswith("cuda") else "gloo"


def timed(fn, device: str):
    """(result, seconds): CPU time of this thread on CPU (blind to other processes), synced wall time on GPU."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0
    t0 = time.thread_time()
    out = fn()
    return out, time.thread_time() - t0


def emulate(slowdown: float, compute_s: float) -> float:
    """Sleep ``slowdown`` times the compute time (a slower device); returns the seconds slept."""
    if slowdown <= 0:
        return 0.0
    t0 = time.perf_counter()
    time.sleep(slowdown * compute_s)
    return time.perf_counter() - t0


@dataclass
class StageArgs:
    """Everything a stage process needs; picklable (the model part travels in shared memory)."""

    rank: int
    world_size: int
    init_method: str
    backend: str
    device: str
    model: nn.Module
    layer_start: int
    layer_end: int
    num_blocks: int
    block_size: int
    kv_bits: int
    slowdown: float
    memory_bytes: int
    threads: int
    parent_pid: int  # the driver's (a fork-served stage's parent is the fork server)
    max_tokens: int  # most tokens (rows) of one micro-batch
    max_layout: int  # most int64s of one micro-batch's layout
    head_start: int = 0  # last stage: the first LM-head row it computes (the driver computes those before)
    vocab: int = 0  # rows of the whole LM head
    emulated: EmulatedDevice | None = None  # --device-cost plan: the device's cost model (slowdown unused)


def _private(model: nn.Module) -> nn.Module:
    """Copy the weights out of the shared memory they arrived in, into this process's own memory
    (the stage then holds nothing of the driver's; measured: no clear speed difference)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()
    return model


def stage_main(args: StageArgs, conn) -> None:
    """Entry point of a stage process (the target of a :func:`engines.stage_procs.stage_context` process)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s stage: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; it stops the stages
    on_exit_of(args.parent_pid, lambda: os._exit(3))  # the driver is gone: so is its pipeline
    torch.set_num_threads(max(1, args.threads))
    try:
        model = _private(args.model).to(args.device)
        runner = ModelRunner(
            model, args.num_blocks, args.block_size, args.kv_bits, range(args.layer_start, args.layer_end)
        )
        conn.send(("ready", os.getpid()))
    except Exception as e:  # reported to the driver, which names the stage
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    dist.init_process_group(
        args.backend,
        init_method=args.init_method,
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(days=365),  # idle stages wait for work; a dead peer is found by the watchdog
    )
    try:
        serve_stage(args, runner, model)
    finally:
        dist.destroy_process_group()


def last_stage_output(
    runner: ModelRunner, h: torch.Tensor, batch: StepBatch, head_start: int, vocab: int
) -> torch.Tensor:
    """What the last stage sends back: the logits of the sampled rows, or, when the driver computes the
    LM head's rows before ``head_start``, the final hidden states followed by this stage's rows."""
    if head_start <= 0:
        return runner.logits(h, batch)
    if not batch.sample_rows:
        return h.new_empty(0, 0)
    x = runner.final_hidden(h, batch)
    return x if head_start >= vocab else torch.cat([x, runner.adapter.lm_head(x)], dim=1)


def last_stage_greedy(
    runner: ModelRunner, h: torch.Tensor, batch: StepBatch, head_start: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A greedy micro-batch's reply: ``(tokens, payload)``. The tokens are the first index of the
    largest logit of this stage's LM-head rows for every sampled row; when the driver computes the
    rows before ``head_start``, the payload is ``[final hidden | that largest logit]`` for it to
    compare with its own rows' (``None`` otherwise)."""
    if not batch.sample_rows:
        return torch.zeros(0, dtype=torch.long), None
    if head_start <= 0:
        return runner.logits(h, batch).max(dim=-1).indices, None
    x = runner.final_hidden(h, batch)
    if head_start >= vocab:
        return torch.zeros(0, dtype=torch.long), x
    best = runner.adapter.lm_head(x).max(dim=-1)
    return best.indices + head_start, torch.cat([x, best.values[:, None]], dim=1)


def serve_stage(args: StageArgs, runner: ModelRunner, model: nn.Module) -> None:
    """Receive, compute, forward until ``STOP``."""
    last = args.rank == args.world_size - 1
    counters = StageCounters(memory_bytes=args.memory_bytes)
    hidden, dtype = hidden_size(model), model_dtype(model)
    S = args.world_size
    inbox = Inbox(args.rank - 1, capacity(args.max_layout, S, NUM_COUNTERS, args.max_tokens, hidden, dtype))
    outbox = Outbox(0 if last else args.rank + 1)
    while True:
        t0 = time.perf_counter()
        msg = unpack(inbox.get(), S, NUM_COUNTERS, dtype)
        counters.values["idle_s"] += time.perf_counter() - t0
        if msg.kind == STOP:
            if not last:
                outbox.send(pack(STOP, msg.layout[:0], msg.counters, None))
            outbox.flush()
            return
        batch = StepBatch.from_tensor(msg.layout)
        h = msg.payload.to(args.device)
        greedy = last and bool(msg.flags & GREEDY)

        def compute(h=h, batch=batch, greedy=greedy):
            with torch.inference_mode():
                out = runner.forward(h, batch)
                if greedy:
                    return last_stage_greedy(runner, out, batch, args.head_start, args.vocab)
                return last_stage_output(runner, out, batch, args.head_start, args.vocab) if last else out

        started = time.perf_counter()
        out, compute_s = timed(compute, args.device)
        if args.emulated is None:
            counters.record(batch, compute_s, emulate(args.slowdown, compute_s))
        else:
            hold = Hold()
            counters.record(batch, compute_s, hold.part(args.emulated.micro_batch_s(batch), started))
            hold.record(counters.clock)
        msg.counters[args.rank] = counters.row()
        if greedy:
            tokens, payload = out
            outbox.send(pack(STEP, tokens.cpu(), msg.counters, payload, msg.flags))
        else:
            outbox.send(pack(STEP, msg.layout[:0] if last else msg.layout, msg.counters, out, msg.flags))
        inbox.release()
