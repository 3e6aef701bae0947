"""The native iteration-level engine: each step is schedule -> run model -> update.

Queries join the running batch at the next step after they fit the KV budget (admission by
predicted total length), leave the moment they finish (their KV blocks return to the pool),
and never wait for the longest member of a batch. Implements :class:`engines.interface.Engine`.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections import deque
from dataclasses import replace

import torch

from engines.config import EngineConfig
from engines.device import DeviceClock
from engines.emulation import Hold
from engines.interface import EngineStats, Request, RequestOutput
from engines.kv_cache import KVCacheManager
from engines.model_runner import ModelRunner, make_adapter
from engines.partials import partial_of, resumed_ids, text_of
from engines.pipeline import PipelineRunner
from engines.plan import apply_plan, plan_head_split, plan_stages, quantized_model
from engines.sampler import sample
from engines.scheduler import Scheduler, SchedulerOutput
from engines.sequence import Sequence, SequenceStatus
from engines.stage_spec import StageSpec
from engines.step_batch import StepBatch
from localmodels import load_or_build
from localmodels.prompt_ids import prompt_ids
from quant.apply import keep_dequantized
from workqueue.partial import Partial

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    @classmethod
    def build(
        cls, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None, *, own_model: bool = False
    ) -> LLMEngine:
        """The engine for ``model`` under ``config``, with its plan applied: the plan's limits go on a
        copy of ``config``, its per-layer bits on a quantized copy of ``model`` (``own_model``: the
        caller hands the model over, quantize it in place). The caller's model and config are left
        as they were."""
        config = copy.deepcopy(config) if config is not None else EngineConfig()
        config.validate()
        notes: list[str] = []
        if config.plan_path:
            notes = apply_plan(config)
            model, more = quantized_model(model, config.plan_path, copy_model=not own_model)
            notes += more
            if config.pipeline.emulate_cost and keep_dequantized(model):
                notes.append(
                    "quantized layers keep their dequantized weights: the devices' time is their cost model's"
                )
        return cls(model, tokenizer, config, plan_notes=notes)

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        config: EngineConfig | None = None,
        *,
        plan_notes: list[str] | None = None,
    ) -> None:
        """Wire ``model`` (used as it is) and a copy of ``config`` into an engine. A config with a plan
        must come through :meth:`build`, which applies the plan first (``plan_notes`` says it did)."""
        self.config = config = copy.deepcopy(config) if config is not None else EngineConfig()
        config.validate()
        if config.plan_path and plan_notes is None:
            raise ValueError("an engine with a plan is made by LLMEngine.build, which applies the plan")
        self.plan_notes = list(plan_notes or [])
        self.tokenizer = tokenizer
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if self.eos_token_id is None:
            self.eos_token_id = getattr(model.config, "eos_token_id", None)
        per_token = ModelRunner.kv_bytes_per_token(model, config.kv_bits)
        budget = config.kv_budget_tokens
        if config.kv_budget_bytes is not None:
            budget = config.kv_budget_bytes // per_token
        num_blocks = max(1, budget // config.block_size)
        self.kv = KVCacheManager(num_blocks, config.block_size, prefix_cache=config.prefix_cache)
        self.stages = self._stages(model, config)
        self.pipeline: PipelineRunner | None = None
        emulate = config.pipeline.emulate_cost
        if emulate and not config.plan_path:
            raise ValueError("emulating devices by their cost model needs a plan whose devices carry one")
        # a one-stage plan emulates its device here (a pipeline's stages do it themselves)
        self.emulated = self.stages[0].emulated(1, 0.0) if emulate and len(self.stages) == 1 else None
        self.device_clock = DeviceClock()
        if len(self.stages) > 1:
            pc = config.pipeline
            self.pipeline = PipelineRunner(
                model,
                self.stages,
                num_blocks,
                config.block_size,
                config.kv_bits,
                pc.init_method,
                pc.backend,
                config.device,
                pc.start_timeout_s,
                max_tokens=config.max_batch_tokens,
                max_sampled=min(config.max_batch_tokens, config.max_running),
                head_split=plan_head_split(config.plan_path or "", pc),
                emulate_cost=emulate,
            )
            self.runner = self.pipeline.stage0
        else:
            self.runner = ModelRunner(
                model, num_blocks, config.block_size, config.kv_bits, device=config.device
            )
        self.num_stages = len(self.stages)
        self.max_positions = self._max_positions(model)
        self.scheduler = Scheduler(config, self.kv, self.eos_token_id, self.max_positions)
        self._inflight: deque[tuple[SchedulerOutput, torch.Tensor | None]] = deque()
        self._kv_step = 0  # KV tokens held during the last step (stats: kv_step_tokens)
        self._forwards: list[tuple[int, int, int]] = []  # the last step's forward passes (stats)
        self._busy: set[str] = set()  # queries in a micro-batch in flight
        self._aborting: set[str] = set()  # aborted while in flight: finished when their micro-batch is back
        self._done: list[RequestOutput] = []  # aborted / rejected, returned by the next step()
        self._recent: deque[tuple[float, int]] = deque()
        self.generated_tokens = 0
        self.num_steps = 0
        self.cumulative_kv_tokens = 0  # sum over steps of tokens cached by the running batch
        self.num_preemptions = 0
        log.info(
            "engine ready: %d KV blocks x %d tokens (%.1f MiB), max %d running, %d tokens/step, prefix cache %s",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size * per_token / 2**20,
            config.max_running,
            config.max_batch_tokens,
            "on" if config.prefix_cache else "off",
        )

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | None = None,
        arch: str = "llama",
        size: str = "tiny",
        config: EngineConfig | None = None,
    ) -> LLMEngine:
        """A real model directory when given, else a random ``arch``/``size`` model with the default tokenizer."""
        config = config or EngineConfig()
        config.validate()
        model, tok = load_or_build(model_dir, arch=arch, size=size, dtype=_DTYPES[config.dtype])
        return cls.build(model, tok, config, own_model=True)

    @staticmethod
    def _stages(model: torch.nn.Module, config: EngineConfig) -> list[StageSpec]:
        """The plan's stages (one whole-model stage without a plan)."""
        n_layers = make_adapter(model).num_layers
        if not config.plan_path:
            return [StageSpec(0, 0, n_layers)]
        stages = plan_stages(config.plan_path, n_layers, config.pipeline.even_split)
        if len(stages) == 1:  # in-process; a layer-count mismatch is reported by quantized_model
            stages = [replace(stages[0], layer_end=n_layers)]
        elif stages[-1].layer_end != n_layers:
            raise ValueError(f"plan stages cover {stages[-1].layer_end} layers, the model has {n_layers}")
        return stages

    def close(self) -> None:
        """Stop the pipeline's stage processes (nothing to do for a one-process engine)."""
        if self.emulated is not None and self.device_clock.steps:
            log.info("emulated plan device: %s", self.device_clock.describe())
        if self.pipeline is not None:
            self.pipeline.close()

    @staticmethod
    def _max_positions(model: torch.nn.Module) -> int | None:
        cfg = model.config
        for name in ("max_position_embeddings", "n_positions"):
            if getattr(cfg, name, None):
                return int(getattr(cfg, name))
        return None

    # ---- the Engine protocol ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.scheduler:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        request.sampling.validate()
        ids = request.prompt_token_ids
        if ids is None:
            ids = prompt_ids(self.tokenizer, request.prompt)
        seq = Sequence.from_request(request, ids, resumed_ids(self.tokenizer, request.resume))
        if not seq.arrival_time:
            seq.arrival_time = time.time()
        error = ""
        if not ids:
            error = "empty prompt"
        elif seq.num_prompt_tokens + 1 > self.kv.total_tokens:
            error = f"prompt of {seq.num_prompt_tokens} tokens does not fit the KV cache ({self.kv.total_tokens} tokens)"
        elif self.max_positions and seq.num_prompt_tokens >= self.max_positions:
            error = (
                f"prompt of {seq.num_prompt_tokens} tokens exceeds the model's {self.max_positions} positions"
            )
        # done: it resumed a partial output that already ended (nothing is left to generate)
        done = seq.output_token_ids and self.scheduler.stop_reason(seq, seq.output_token_ids[-1])
        if error or done:
            self._done.append(self._output(seq, "error" if error else done, error))
            return
        self.scheduler.add(seq)

    # ---- engines.interface.Resumable -------------------------------------------------------
    steps_generate = True

    def progress(self) -> dict[str, int]:
        """How many tokens each query the engine holds generated so far."""
        return {rid: len(seq.output_token_ids) for rid, seq in self.scheduler.requests.items()}

    def partial(self, request_id: str) -> Partial | None:
        """A query's generated tokens and their text (None: not here)."""
        seq = self.scheduler.requests.get(request_id)
        return None if seq is None else partial_of(self.tokenizer, seq.output_token_ids)

    def suspend(self, request_id: str) -> Partial | None:
        """Take a query out without an output; its generated tokens (None: not here, or in flight)."""
        if request_id in self._busy:
            return None
        seq = self.scheduler.remove(request_id)
        return None if seq is None else partial_of(self.tokenizer, seq.output_token_ids)

    def abort_request(self, request_id: str) -> None:
        if request_id in self._busy:  # its KV is being written by a stage: finish it when it is back
            self._aborting.add(request_id)
            return
        seq = self.scheduler.remove(request_id)
        if seq is not None:
            seq.status = SequenceStatus.FINISHED
            self._done.append(self._output(seq, "abort"))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._done)

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> run model -> update; returns the queries finished in it.

        With S pipeline stages, up to S micro-batches (disjoint sets of queries) are in flight:
        the step schedules and submits micro-batches until S are in flight, then takes the
        oldest one back, samples and updates. With one stage that is schedule -> run -> update.
        """
        finished, self._done = self._done, []
        self._forwards = []
        while len(self._inflight) < self.num_stages:
            plan = self.scheduler.schedule(self._busy)
            finished.extend(self._unschedulable(plan))
            if not plan.chunks:
                break
            self._forwards.append(plan.forward())
            batch = StepBatch.from_chunks(plan.chunks, self.kv.block_size)
            if self.pipeline is None:
                self._inflight.append((plan, self._run_one(batch)))
            else:
                greedy = all(c.seq.sampling.temperature <= 0 for c in plan.chunks if c.samples)
                self.pipeline.submit(batch, greedy)
                self._inflight.append((plan, None))
            self._busy.update(c.seq.request_id for c in plan.chunks)
        if not self._inflight:
            return finished
        self._kv_step = self.kv.used_blocks * self.kv.block_size  # held while this step runs
        plan, logits = self._inflight.popleft()
        out = self.pipeline.result() if logits is None else logits  # logits, or a greedy batch's tokens
        self._busy.difference_update(c.seq.request_id for c in plan.chunks)
        sampling = [c.seq for c in plan.chunks if c.samples]
        if isinstance(out, list):
            tokens = out
        else:
            tokens = sample(out, sampling) if sampling else []
        finished.extend(self._update(plan, sampling, tokens))
        for rid in [r for r in self._aborting if r not in self._busy]:
            self._aborting.discard(rid)
            self.abort_request(rid)
        return finished

    def _run_one(self, batch: StepBatch) -> torch.Tensor:
        """The logits of a one-stage engine's micro-batch, on its emulated device when it has one."""
        if self.emulated is None:
            return self.runner.run_batch(batch)
        hold, started = Hold(), time.perf_counter()
        logits = self.runner.run_batch(batch)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        hold.part(self.emulated.micro_batch_s(batch), started)
        hold.record(self.device_clock)
        return logits

    def _device_counts(self) -> tuple[int, int]:
        """Micro-batches charged by the emulated devices' cost models, and their overruns (all stages)."""
        if self.pipeline is None:
            return self.device_clock.steps, self.device_clock.overrun_steps
        rows = self.pipeline.stage_counters()
        return int(sum(r["device_steps"] for r in rows)), int(sum(r["device_overrun_steps"] for r in rows))

    def _unschedulable(self, plan: SchedulerOutput) -> list[RequestOutput]:
        out = []
        for seq in plan.out_of_memory:  # the scheduler already let it go: the query fails, it has no answer
            need = seq.num_prompt_tokens + len(seq.output_token_ids) + 1
            why = f"the KV cache ({self.kv.total_tokens} tokens) cannot hold this query: it needs {need} or more"
            out.append(self._output(seq, "error", why))
        if plan.preempted:
            self.num_preemptions += len(plan.preempted)
            log.debug("preempted %s (KV blocks ran out)", [s.request_id for s in plan.preempted])
        return out

    def stats(self) -> EngineStats:
        now = time.monotonic()
        window = self.config.stats_window_s
        while self._recent and now - self._recent[0][0] > window:
            self._recent.popleft()
        rate = 0.0
        if len(self._recent) >= 2:
            span = max(self._recent[-1][0] - self._recent[0][0], 1e-6)
            rate = sum(n for _, n in list(self._recent)[1:]) / span
        steps, overruns = self._device_counts()
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_used_tokens=self.kv.used_blocks * self.kv.block_size,
            kv_total_tokens=self.kv.total_tokens,
            tokens_per_s=rate,
            generated_tokens=self.generated_tokens,
            kv_step_tokens=self._kv_step,
            step_forwards=tuple(self._forwards),
            device_steps=steps,
            device_overrun_steps=overruns,
            prefix_lookup_tokens=self.kv.lookup_tokens,
            prefix_hit_tokens=self.kv.hit_tokens,
        )

    def free_slots(self) -> int:
        """Queries that fit now (by running count and KV reservation) plus ``queue_depth``, minus those waiting."""
        s = self.scheduler
        room = self.config.max_running - len(s.running)
        free_kv = self.kv.total_tokens - s.committed_tokens()
        running = s.running or list(s.waiting)
        typical = (  # a query's own part: cached blocks shared with others are counted once, apart
            sum(s.reservation(q) - q.num_cached_tokens for q in running) / len(running)
            if running
            else self.config.default_predicted_tokens * (1 + self.config.safety_margin)
        )
        room = min(room, math.floor(max(0, free_kv) / max(typical, 1.0)))
        return max(0, room + self.config.queue_depth - len(s.waiting))

    # ---- helpers ------------------------------------------------------------------------
    def _update(
        self, plan: SchedulerOutput, sampling: list[Sequence], tokens: list[int]
    ) -> list[RequestOutput]:
        """The scheduler applies the step; the engine counts it and turns finished queries into outputs."""
        self.cumulative_kv_tokens += sum(
            c.seq.num_computed + c.num_tokens for c in plan.chunks
        )  # cached after it
        done = self.scheduler.update_from_output(plan, sampling, tokens, time.time())
        self.num_steps += 1
        self.generated_tokens += len(tokens)
        self._recent.append((time.monotonic(), len(tokens)))
        return [self._output(seq, reason) for seq, reason in done]

    def _output(self, seq: Sequence, reason: str, error: str = "") -> RequestOutput:
        seq.finish_reason = reason
        seq.finish_time = time.time()
        ids = seq.output_token_ids
        return RequestOutput(
            request_id=seq.request_id,
            text=text_of(self.tokenizer, ids),
            token_ids=list(ids),
            prompt_tokens=seq.num_prompt_tokens,
            finish_reason=reason,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
            error=error,
        )

    def generate(self, requests: list[Request], progress: bool = False) -> list[RequestOutput]:
        """Run a list of requests to completion; outputs in the order of ``requests``."""
        from tqdm import tqdm

        for r in requests:
            self.add_request(r)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), disable=not progress, desc="generate", unit="query") as bar:
            while self.has_unfinished():
                for out in self.step():
                    results[out.request_id] = out
                    bar.update(1)
        return [results[r.request_id] for r in requests]
