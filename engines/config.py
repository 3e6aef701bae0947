"""Engine configuration: KV budget, block size, step limits, admission margin, optional plan file."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass
class PipelineConfig:
    """How a multi-stage plan runs: one process per stage after the first, talking ``torch.distributed``.

    ``init_method`` is the rendezvous (``tcp://HOST:PORT``; default a free loopback port).
    ``backend`` ``auto`` picks NCCL on CUDA and gloo on CPU (stages run on the engine's
    ``device``; only the CPU so far). ``even_split`` ignores the plan's
    layer ranges and splits the layers evenly over its stages (the baseline a plan is measured
    against). ``head_split`` False keeps the whole LM head on the last stage even where the plan
    gives the first stage a share of its rows (the baseline the share is measured against).
    ``emulate_cost`` (``fleetbatch engine serve --device-cost plan``): every stage, a one-stage plan too, makes
    each micro-batch last what its plan device's cost model charges for it (:mod:`engines.emulation`).
    """

    init_method: str | None = None
    backend: str = "auto"
    even_split: bool = False
    head_split: bool = True
    start_timeout_s: float = 120.0
    emulate_cost: bool = False


@dataclass
class EngineConfig:
    """Knobs of :class:`engines.engine.LLMEngine`.

    The KV budget is given in tokens (``kv_budget_tokens``) or in bytes (``kv_budget_bytes``,
    converted with the model's per-token KV size); bytes win when both are set. ``device`` is
    where the model runner computes (``cpu``, ``cuda`` or ``cuda:N``); a CUDA device that is not
    there is an error when the engine is built, never a silent fallback to the CPU.
    """

    kv_budget_tokens: int = 16384
    kv_budget_bytes: int | None = None
    block_size: int = 16
    max_batch_tokens: int = 512  # tokens computed per step (prefill chunks + one per decode)
    prefill_chunk: int = 256  # longest prefill piece of one query in one step
    max_running: int = 64  # queries in the running batch at once
    safety_margin: float = 0.10  # admission reserves prompt + predicted * (1 + margin)
    default_predicted_tokens: int = 128  # used when a request has no prediction (capped by max_tokens)
    queue_depth: int = 2  # free_slots(): requests kept queued inside the engine beyond what fits
    kv_bits: int = 16  # 16: KV in the model dtype; 8: int8 KV (needs quant.kv)
    plan_path: str | None = None  # plan.json: stages, per-layer bits, micro-batch sizes
    decode_micro_batch: int | None = None  # most decoding queries in one micro-batch (None: no limit)
    prefill_micro_batch: int | None = None  # most prefilling queries in one micro-batch (None: no limit)
    pipeline: PipelineConfig = field(default_factory=lambda: PipelineConfig())
    dtype: str = "float32"
    device: str = "cpu"  # the model runner's device: cpu, cuda, cuda:N
    stats_window_s: float = 10.0  # window of the tokens/s figure in stats()
    prefix_cache: bool = True  # reuse cached KV blocks of shared prompt prefixes (engines.kv_cache)

    def validate(self) -> None:
        checks = [
            (self.kv_budget_tokens >= 1, f"kv_budget_tokens must be >= 1, got {self.kv_budget_tokens}"),
            (
                self.kv_budget_bytes is None or self.kv_budget_bytes >= 1,
                f"kv_budget_bytes must be >= 1, got {self.kv_budget_bytes}",
            ),
            (self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}"),
            (self.max_batch_tokens >= 1, f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}"),
            (self.prefill_chunk >= 1, f"prefill_chunk must be >= 1, got {self.prefill_chunk}"),
            (self.max_running >= 1, f"max_running must be >= 1, got {self.max_running}"),
            (self.safety_margin >= 0, f"safety_margin must be >= 0, got {self.safety_margin}"),
            (
                self.default_predicted_tokens >= 1,
                f"default_predicted_tokens must be >= 1, got {self.default_predicted_tokens}",
            ),
            (self.queue_depth >= 0, f"queue_depth must be >= 0, got {self.queue_depth}"),
            (
                self.decode_micro_batch is None or self.decode_micro_batch >= 1,
                f"decode_micro_batch must be >= 1, got {self.decode_micro_batch}",
            ),
            (
                self.prefill_micro_batch is None or self.prefill_micro_batch >= 1,
                f"prefill_micro_batch must be >= 1, got {self.prefill_micro_batch}",
            ),
            (self.kv_bits in (16, 8), f"kv_bits must be 16 or 8, got {self.kv_bits}"),
            (
                self.dtype in ("float32", "bfloat16", "float16"),
                f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}",
            ),
            (
                self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device) is not None,
                f"device must be cpu, cuda or cuda:N, got {self.device!r}",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
