"""The vLLM backend (GPU only): a plan translated into vLLM engine arguments, driven step by step.

:func:`plan_to_vllm` is pure and tested everywhere: pipeline stages become
``pipeline_parallel_size`` and ``VLLM_PP_LAYER_PARTITION``, tensor-parallel groups
``tensor_parallel_size`` (vLLM needs the same size in every stage); micro-batch sizes bound
``max_num_seqs`` / ``max_num_batched_tokens``; KV bits pick ``kv_cache_dtype``. vLLM has
no per-layer mixed weight precision, so a mixed bit map is served at the *widest* bit
width in the plan (never below the plan's quality), and the translation says so in its
``notes``, as it says what else of the plan vLLM cannot honour (bits below 8, KV below 8 bits, a
head split, unlike devices per stage). :func:`vllm_engine_args` adds the user's ``--vllm-arg``
(:mod:`engines.vllm_args`) over the plan's values, logs each note as a warning and each override;
nothing else is set, so vLLM's own defaults hold (``dtype``, ``gpu_memory_utilization``, and
``max_num_seqs`` unless a plan or ``--max-running`` gives it). The engine over ``vllm.LLMEngine`` is
:class:`engines.vllm_engine.VLLMEngine`; vLLM is imported only when the vLLM backend is chosen, after the
arguments are checked.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from engines.vllm_args import FLAG, given, override, parse_vllm_args
from planfile import load_plan

log = logging.getLogger(__name__)

#: the environment variable of vLLM's uneven pipeline layer split
PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


@dataclass
class VLLMArgs:
    engine_args: dict[str, Any]
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)


def plan_to_vllm(
    plan, model_dir: str, gpu_memory_utilization: float | None = None, max_model_len: int | None = None
) -> VLLMArgs:
    """Engine arguments and environment for serving ``plan`` (a :class:`planfile.Plan`) with vLLM.

    Only what vLLM supports is translated; ``notes`` says what of the plan is not honoured: per-layer
    bits (a mixed map runs at its widest width; below 8 bits needs a pre-quantized checkpoint), KV bits
    below 8, the LM head split, and which GPU runs which stage (vLLM places pipeline ranks in CUDA order).
    ``gpu_memory_utilization`` and ``max_model_len`` are set only when given (else vLLM's defaults);
    ``dtype`` never (vLLM's ``auto``: the checkpoint's).
    """
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
        "max_num_seqs": max(1, plan.batch_size),
        "max_num_batched_tokens": max(
            plan.prompt_len * max(1, plan.prefill_micro_batch), plan.prompt_len + 1
        ),
        "enable_chunked_prefill": True,
        "kv_cache_dtype": "fp8" if plan.kv_bits <= 8 else "auto",
    }
    if gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = gpu_memory_utilization
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
    types = [str(plan.devices[s.device_index].get("type", "?")) for s in stages]
    if len(set(types)) > 1:
        notes.append(
            f"the plan puts its stages on {', '.join(types)} in that order; vLLM gives pipeline rank k the "
            "k-th GPU of CUDA_VISIBLE_DEVICES, so list the GPUs in the plan's stage order"
        )
    env = {PARTITION_ENV: ",".join(str(n) for n in layers)} if len(stages) > 1 else {}
    return VLLMArgs(args, env, notes)


def _ignored_by_user(plan_args: dict[str, Any], env: dict[str, str], user: dict[str, Any]) -> list[str]:
    """What of the plan the user's arguments stop vLLM from honouring."""
    notes = []
    pp = user.get("pipeline_parallel_size", plan_args["pipeline_parallel_size"])
    if PARTITION_ENV in env and pp != plan_args["pipeline_parallel_size"]:
        notes.append(
            f"the plan's stage split {env[PARTITION_ENV]} is ignored: {FLAG} pipeline_parallel_size={pp} "
            f"(vLLM splits the layers evenly)"
        )
        env.pop(PARTITION_ENV)
    if "quantization" in user and user["quantization"] != plan_args.get("quantization"):
        notes.append(f"the plan's weight bits are ignored: {FLAG} quantization={user['quantization']}")
    if "kv_cache_dtype" in user and user["kv_cache_dtype"] != plan_args.get("kv_cache_dtype"):
        notes.append(f"the plan's KV bits are ignored: {FLAG} kv_cache_dtype={user['kv_cache_dtype']}")
    return notes


def vllm_engine_args(
    served_model: str | None,
    plan=None,
    *,
    max_running: int | None = None,
    prefix_cache: bool = True,
    vllm_args: list[str] | None = None,
) -> VLLMArgs:
    """``vllm.EngineArgs`` keyword arguments and environment of ``fleetbatch engine serve --backend vllm``.

    From, lowest first: the plan's translation (:func:`plan_to_vllm`) or, without a plan, the model and
    ``max_num_seqs`` = ``max_running`` when given (else vLLM's default); ``enable_prefix_caching`` =
    ``prefix_cache``; the user's ``--vllm-arg`` (checked before vLLM is imported: a misspelt key is a
    ValueError naming the closest ones). Each override of the plan or the flags is logged, and each note
    on what of the plan vLLM cannot honour is logged as a warning. ``None`` values are left out.
    """
    user = parse_vllm_args(vllm_args)
    model_dir = served_model or user.get("model")
    if not model_dir:
        raise ValueError("the vLLM backend needs --served-model DIR (a local Hugging Face model directory)")
    if plan is not None:
        t = plan_to_vllm(
            plan,
            model_dir,
            gpu_memory_utilization=user.get("gpu_memory_utilization"),
            max_model_len=user.get("max_model_len"),
        )
        base, env, notes, source = dict(t.engine_args), dict(t.env), list(t.notes), "the plan"
        notes += _ignored_by_user(base, env, user)
        if max_running is not None and max_running != base["max_num_seqs"]:
            log.info(
                "--max-running %d is not used: the plan's batch size sets max_num_seqs=%d (%s max_num_seqs=N "
                "overrides it)", max_running, base["max_num_seqs"], FLAG,
            )  # fmt: skip
    else:
        base, env, notes, source = {"model": model_dir}, {}, [], "the flags"
        if max_running is not None:
            base["max_num_seqs"] = max_running
    base["enable_prefix_caching"] = prefix_cache
    merged, said = override(base, user, source)
    for line in said:
        log.info("%s", line)
    for note in notes:
        log.warning("vLLM cannot honour the plan here: %s", note)
    return VLLMArgs({k: v for k, v in merged.items() if v is not None}, env, notes)


def engine_kwargs(args) -> dict[str, Any]:
    """``vllm.EngineArgs`` keyword arguments of ``fleetbatch engine serve --backend vllm``
    (:func:`vllm_engine_args` of its flags); the plan's environment goes into ``os.environ``."""
    t = vllm_engine_args(
        args.served_model,
        load_plan(args.plan) if args.plan else None,
        max_running=given(getattr(args, "max_running", None)),
        prefix_cache=getattr(args, "prefix_cache", True),
        vllm_args=getattr(args, "vllm_arg", None),
    )
    os.environ.update(t.env)
    return t.engine_args
