"""The vLLM backend (GPU only): a plan translated into vLLM engine arguments, driven step by step.

:func:`plan_to_vllm` is pure and tested everywhere: pipeline stages become
``pipeline_parallel_size`` and ``VLLM_PP_LAYER_PARTITION``, tensor-parallel groups
``tensor_parallel_size`` (vLLM needs the same size in every stage); micro-batch sizes bound
``max_num_seqs`` / ``max_num_batched_tokens``; KV bits pick ``kv_cache_dtype``. vLLM has
no per-layer mixed weight precision, so a mixed bit map is served at the *widest* bit
width in the plan (never below the plan's quality), and the translation says so in its
``notes``. :class:`VLLMEngine` implements :class:`engines.interface.Engine` on
``vllm.LLMEngine``; it is imported only when the vLLM backend is chosen.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from engines.interface import EngineStats, Request, RequestOutput
from planfile import load_plan


@dataclass
class VLLMArgs:
    engine_args: dict[str, Any]
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)


def plan_to_vllm(
    plan, model_dir: str, gpu_memory_utilization: float = 0.90, max_model_len: int | None = None
) -> VLLMArgs:
    """Engine arguments and environment for serving ``plan`` (a :class:`planfile.Plan`) with vLLM."""
    if not model_dir:
        raise ValueError("the vLLM backend needs --served-model DIR (a local Hugging Face model directory)")
    stages = sorted(plan.stages, key=lambda s: s.layer_start)
    if not stages:
        raise ValueError("plan has no stages")
    layers = [s.layer_end - s.layer_start for s in stages]
    if any(n <= 0 for n in layers):
        raise ValueError(f"plan has an empty stage: layers per stage {layers}")
    notes: list[str] = []
    tp_sizes = sorted({len(s.devices_of_stage) for s in stages})
    if len(tp_sizes) > 1:
        raise ValueError(
            f"the plan mixes tensor-parallel sizes {tp_sizes} across stages; vLLM needs one size "
            "for every pipeline stage: re-plan with `fleetbatch planner plan --tp-sizes N`"
        )
    bits = sorted({b for s in stages for b in s.bits})
    widest = max(bits)
    args: dict[str, Any] = {
        "model": model_dir,
        "tokenizer": model_dir,
        "pipeline_parallel_size": len(stages),
        "tensor_parallel_size": tp_sizes[0],
        "gpu_memory_utilization": gpu_memory_utilization,
        "max_num_seqs": max(1, plan.batch_size),
        "max_num_batched_tokens": max(
            plan.prompt_len * max(1, plan.prefill_micro_batch), plan.prompt_len + 1
        ),
        "enable_chunked_prefill": True,
        "dtype": "float16",
        "kv_cache_dtype": "fp8" if plan.kv_bits <= 8 else "auto",
        "seed": 0,
    }
    if max_model_len:
        args["max_model_len"] = max_model_len
    if widest >= 16:
        args["quantization"] = None
    elif widest == 8:
        args["quantization"] = "fp8"  # online weight quantization to 8 bits
    else:
        args["quantization"] = None
        notes.append(
            f"plan uses {widest}-bit weights everywhere; vLLM needs a pre-quantized (AWQ/GPTQ) checkpoint "
            "for that, so this serves 16-bit weights unless --served-model points at one"
        )
    if len(bits) > 1:
        notes.append(
            f"mixed bit map {bits} served at the widest width ({widest} bits): vLLM has no per-layer precision"
        )
    if plan.kv_bits < 8:
        notes.append(f"{plan.kv_bits}-bit KV cache is not available in vLLM; using fp8")
    if plan.head_split > 0:
        notes.append(
            f"the plan gives the first stage {plan.head_split:.0%} of the LM head's rows; vLLM keeps the whole "
            "head on the last stage, so its last stage runs slower than the plan predicts"
        )
    env = {"VLLM_PP_LAYER_PARTITION": ",".join(str(n) for n in layers)} if len(stages) > 1 else {}
    return VLLMArgs(args, env, notes)


def sampling_kwargs(request: Request) -> dict[str, Any]:
    """vLLM ``SamplingParams`` keyword arguments for a request (forced length = ignore EOS, exact count)."""
    s = request.sampling
    kw: dict[str, Any] = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_tokens": s.target_tokens,
        "seed": s.seed,
    }
    if s.forced_length is not None:
        kw.update(ignore_eos=True, min_tokens=s.forced_length)
    return kw


def engine_kwargs(args) -> dict[str, Any]:
    """``vllm.EngineArgs`` keyword arguments of ``fleetbatch engine serve --backend vllm``: the plan's translation
    (its environment goes into ``os.environ``) or the model and batch size; prefix caching on unless
    ``--no-prefix-cache``."""
    if args.plan:
        translated = plan_to_vllm(load_plan(args.plan), args.served_model)
        os.environ.update(translated.env)
        kwargs = {k: v for k, v in translated.engine_args.items() if v is not None}
    else:
        if not args.served_model:
            raise ValueError(
                "the vLLM backend needs --served-model DIR (a local Hugging Face model directory)"
            )
        kwargs = {"model": args.served_model, "max_num_seqs": args.max_running}
    kwargs["enable_prefix_caching"] = getattr(args, "prefix_cache", True)
    return kwargs


class VLLMEngine:
    """:class:`engines.interface.Engine` over ``vllm.LLMEngine`` (iteration-level batching is vLLM's own)."""

    def __init__(self, llm_engine, max_running: int = 256):
        self.llm = llm_engine
        self.max_running = max_running
        self._unfinished: set[str] = set()
        self._first_token: dict[str, float] = {}
        self._seen_tokens: dict[str, int] = {}
        self._aborted: list[str] = []
        self._generated = 0
        self._window: list[tuple[float, int]] = []

    @classmethod
    def from_args(cls, args) -> VLLMEngine:
        from vllm import EngineArgs, LLMEngine

        kwargs = engine_kwargs(args)
        return cls(
            LLMEngine.from_engine_args(EngineArgs(**kwargs)), max_running=kwargs.get("max_num_seqs", 256)
        )

    def add_request(self, request: Request) -> None:
        from vllm import SamplingParams

        request.sampling.validate()
        self.llm.add_request(request.request_id, request.prompt, SamplingParams(**sampling_kwargs(request)))
        self._unfinished.add(request.request_id)

    def abort_request(self, request_id: str) -> None:
        self.llm.abort_request(request_id)
        if request_id in self._unfinished:
            self._unfinished.discard(request_id)
            self._aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._unfinished) or bool(self._aborted)

    def free_slots(self) -> int:
        return max(0, self.max_running - len(self._unfinished))

    def stats(self) -> EngineStats:
        secs = sum(s for s, _ in self._window[-32:])
        toks = sum(t for _, t in self._window[-32:])
        return EngineStats(
            running=len(self._unfinished),
            tokens_per_s=toks / secs if secs > 0 else 0.0,
            generated_tokens=self._generated,
        )

    def step(self) -> list[RequestOutput]:
        out = [RequestOutput(r, "", [], 0, "abort", finish_time=time.time()) for r in self._aborted]
        self._aborted = []
        t0 = time.time()
        produced = 0
        for o in self.llm.step():
            comp = o.outputs[0]
            self._first_token.setdefault(o.request_id, time.time())
            produced += len(comp.token_ids) - self._seen_tokens.get(o.request_id, 0)
            self._seen_tokens[o.request_id] = len(comp.token_ids)
            if not o.finished:
                continue
            self._unfinished.discard(o.request_id)
            self._seen_tokens.pop(o.request_id, None)
            out.append(
                RequestOutput(
                    o.request_id,
                    comp.text,
                    list(comp.token_ids),
                    len(o.prompt_token_ids or []),
                    "stop" if comp.finish_reason == "stop" else "length",
                    first_token_time=self._first_token.pop(o.request_id, time.time()),
                    finish_time=time.time(),
                )
            )
        self._generated += produced
        self._window.append((time.time() - t0, produced))
        return out
