"""Check A of the GPU check: the native engine on a device, one process and with a 2-stage plan.

``python -m engines.bench.gpu_check_native --served-model D --plan P --device cuda [--workload JSON]``
(started by :mod:`engines.bench.gpu_check`, which gives it a time limit) runs the saved model

* on the CPU, greedily, on the first ``compare`` prompts: the reference;
* on ``--device`` in one process: the same prompts (are the greedy tokens the CPU's?), then all
  ``queries`` prompts after a warm-up, timed (tokens/s);
* on ``--device`` with the plan's 2 stages (stage processes on the same device, the engine's
  choice of ``torch.distributed`` backend): the same. An engine that refuses stages on this
  device is reported as ``skipped`` with its reason.

All runs are float32, so the CPU and the GPU compute the same function; TF32 is kept off. The
GPU's kernels still round differently from the CPU's, so a random-weight model's near-tied
logits may pick another token: a mismatch is reported (where it starts), not failed.
The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from engines.bench.gpu_check_setup import Workload, prompt_ids
from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from engines.stage_worker import backend_for
from localmodels import load_model

log = logging.getLogger("gpu-check")


def requests(prompts: list[list[int]], length: int, tag: str) -> list[Request]:
    sp = SamplingParams(max_tokens=length, forced_length=length)
    return [
        Request(f"{tag}{i}", "", replace(sp), prompt_token_ids=list(p), predicted_tokens=length)
        for i, p in enumerate(prompts)
    ]


def engine_config(w: Workload, device: str, plan: str | None) -> EngineConfig:
    return EngineConfig(
        kv_budget_tokens=w.queries * (w.prompt_len + w.gen_len) + 256,
        max_batch_tokens=max(512, w.prompt_len + w.queries),
        prefill_chunk=w.prompt_len,
        max_running=w.queries,
        device=device,
        plan_path=plan,
    )


def first_mismatch(ref: list[list[int]], got: list[list[int]]) -> dict[str, int] | None:
    """The first prompt whose tokens differ from the reference, and the first differing position."""
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        if a != b:
            pos = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            return {"prompt": i, "position": pos}
    return None


def compare(ref: list[list[int]], got: list[list[int]], device: str) -> dict[str, Any]:
    same = sum(a == b for a, b in zip(ref, got, strict=True))
    out: dict[str, Any] = {
        "greedy_identical_to_cpu": same == len(ref),
        "matching_prompts": f"{same}/{len(ref)}",
    }
    if same < len(ref):
        out["first_mismatch"] = first_mismatch(ref, got)
        if device != "cpu":
            out["note"] = (
                "float32 on both, TF32 off; the GPU's kernels round differently from the CPU's, so a "
                "random-weight model's near-tied logits can pick another token from there on"
            )
    return out


def run_engine(model_dir: str, w: Workload, prompts, device: str, plan: str | None, ref) -> dict[str, Any]:
    """One configuration on a fresh copy of the model (a runner moves its model to its device):
    build, compare greedy tokens with ``ref``, warm up, time all queries."""
    model, tok = load_model(model_dir)
    t0 = time.perf_counter()
    try:
        engine = LLMEngine.build(model, tok, engine_config(w, device, plan))
    except ValueError as e:  # the engine's refusal of this configuration (e.g. stages on this device)
        return {"status": "skipped", "reason": f"the engine refused: {e}"}
    try:
        built_s = time.perf_counter() - t0
        got = [o.token_ids for o in engine.generate(requests(prompts[: w.compare], w.compare_len, "c"))]
        engine.generate(requests(prompts[:2], 2, "w"))  # warm-up
        t0 = time.perf_counter()
        outs = engine.generate(requests(prompts, w.gen_len, "q"))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    tokens = sum(o.completion_tokens for o in outs)
    bad = [o.request_id for o in outs if o.finish_reason != "length" or o.completion_tokens != w.gen_len]
    result: dict[str, Any] = {
        "status": "failed" if bad else "ran",
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
        "build_s": round(built_s, 2),
        "stages": engine.num_stages,
        **compare(ref, got, device),
    }
    if bad:
        result["error"] = f"queries without exactly {w.gen_len} tokens: {bad[:5]}"
    if engine.pipeline is not None:
        result["layers"] = [[s.layer_start, s.layer_end] for s in engine.stages]
        result["backend"] = backend_for(device, engine.config.pipeline.backend)
    return result


def attempt(fn) -> dict[str, Any]:
    """``fn()``, or what broke in it as a failure."""
    try:
        return fn()
    except Exception as e:  # reported in the JSON: the check's job is to say what broke
        log.exception("native check failed")
        return {"status": "failed", "error": f"{type(e).__name__}: {e}"}


def check(model_dir: str, plan: str, device: str, w: Workload) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, tok = load_model(model_dir)
    prompts = prompt_ids(tok, w)
    log.info("native: CPU reference on %d prompts", w.compare)
    ref_engine = LLMEngine.build(model, tok, engine_config(w, "cpu", None))
    ref = [o.token_ids for o in ref_engine.generate(requests(prompts[: w.compare], w.compare_len, "r"))]
    out: dict[str, Any] = {"device": device, "dtype": "float32", "workload": w.to_dict()}
    log.info("native: one process on %s, %d queries", device, w.queries)
    out["one_process"] = attempt(lambda: run_engine(model_dir, w, prompts, device, None, ref))
    log.info("native: the plan's 2 stages on %s", device)
    out["two_stage"] = attempt(lambda: run_engine(model_dir, w, prompts, device, plan, ref))
    runs = [out["one_process"], out["two_stage"]]
    out["status"] = (
        "failed"
        if any(r["status"] == "failed" for r in runs)
        else "ran"
        if any(r["status"] == "ran" for r in runs)
        else "skipped"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--served-model", required=True)
    p.add_argument("--plan", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--workload", default="{}", help="Workload fields as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gpu-check: %(message)s", stream=sys.stderr)
    out = check(args.served_model, args.plan, args.device, Workload(**json.loads(args.workload)))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
