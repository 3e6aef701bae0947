"""Check B of the GPU check: vLLM serving the saved model with the plan's translated settings.

``python -m engines.bench.gpu_check_vllm --served-model D --plan P [--workload JSON]`` (started by
:mod:`engines.bench.gpu_check` with a time limit) translates the uneven 2-stage plan with
:func:`engines.vllm_backend.plan_to_vllm` into ``pipeline_parallel_size`` 2 and
``VLLM_PP_LAYER_PARTITION``, and runs vLLM offline (``vllm.LLM``) on the saved random model:
greedy, every query forced to ``gen_len`` tokens, timed after a warm-up.

Pipeline parallelism places each rank on its own GPU: with fewer GPUs than the plan's stages
(one GPU), it runs what fits, ``pipeline_parallel_size`` 1 with the rest of the translated
arguments, and says ``pp_skipped`` with the translated settings beside it. ``enforce_eager``
skips CUDA-graph capture, which would take much of the check's time on so small a model.
Then ``resume``: the backend's engine (:class:`engines.vllm_engine.VLLMEngine`) over the same vLLM runs one
query whole, the same query suspended after a few steps, and a third continuing the second's partial output
(:func:`resume_check`): whether the continued answer's ids and text equal the whole one's (greedy), and where
the ids first differ if not. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from engines.bench.gpu_check_setup import Workload
from engines.vllm_backend import plan_to_vllm
from planfile import load_plan

log = logging.getLogger("gpu-check")

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def translate(plan_path: str, model_dir: str, w: Workload, gpus: int) -> dict[str, Any]:
    """The plan's vLLM settings, and what of them runs on ``gpus`` GPUs: ``engine_args`` and ``env``
    to run with, ``translated`` (what the plan asks for), ``pp_skipped`` where PP does not fit."""
    t = plan_to_vllm(
        load_plan(plan_path),
        model_dir,
        gpu_memory_utilization=0.5,
        max_model_len=max(256, w.prompt_len + w.gen_len + 16),
    )
    args = {k: v for k, v in t.engine_args.items() if v is not None}
    pp, tp = args["pipeline_parallel_size"], args["tensor_parallel_size"]
    out: dict[str, Any] = {
        "translated": {
            "pipeline_parallel_size": pp,
            "tensor_parallel_size": tp,
            PARTITION_ENV: t.env.get(PARTITION_ENV),
            "notes": t.notes,
        },
        "engine_args": {**args, "enforce_eager": True},
        "env": dict(t.env),
    }
    if pp * tp > gpus:
        out["pp_skipped"] = "one GPU" if gpus == 1 else f"{gpus} GPUs for {pp * tp} ranks"
        out["engine_args"]["pipeline_parallel_size"] = 1
        out["env"] = {}
    return out


def described(s: dict[str, Any]) -> dict[str, Any]:
    """What the JSON says of the settings, whatever happens next."""
    return {k: s[k] for k in ("translated", "pp_skipped") if k in s}


def run(model_dir: str, w: Workload, s: dict[str, Any]) -> dict[str, Any]:
    """vLLM offline with the settings ``s`` of :func:`translate`: start, warm up, time the queries."""
    from vllm import LLM, SamplingParams

    from engines.bench.gpu_check_setup import prompt_ids
    from localmodels import load_model

    os.environ.pop(PARTITION_ENV, None)
    os.environ.update(s["env"])
    kwargs = s["engine_args"]
    log.info("vllm: LLM(%s) with %s", kwargs, s["env"] or "no partition")
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    _, tok = load_model(model_dir)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(tok, w)]
    sp = SamplingParams(temperature=0.0, max_tokens=w.gen_len, min_tokens=w.gen_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    tokens = sum(lengths)
    ok = lengths == [w.gen_len] * len(prompts)
    result = {
        "status": "ran" if ok else "failed",
        "ran_with": {
            "pipeline_parallel_size": kwargs["pipeline_parallel_size"],
            PARTITION_ENV: s["env"].get(PARTITION_ENV),
        },
        **described(s),
        "start_s": round(start_s, 2),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
        "workload": w.to_dict(),
    }
    if not ok:
        result["error"] = f"forced lengths not kept: got {sorted(set(lengths))}, wanted {w.gen_len}"
    try:
        result["resume"] = resume_check(llm.llm_engine, tok, w.gen_len)
    except Exception as e:  # reported beside the timed run, which stands
        log.exception("vllm resume check failed")
        result["resume"] = {"error": f"{type(e).__name__}: {e}"}
    return result


RESUME_PROMPT = "Rivers carve valleys over millions of years because"


def resume_check(llm_engine, tokenizer, gen_len: int, cut_steps: int = 5, sampling=None) -> dict[str, Any]:
    """One query run whole, suspended after ``cut_steps`` steps, and continued from its partial output, on the
    backend's engine over ``llm_engine`` (greedy, forced to ``gen_len`` tokens): the two answers side by side.
    ``sampling``: what makes the engine's sampling parameters (vLLM's ``SamplingParams`` unless given)."""
    from engines.interface import Request, SamplingParams
    from engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(llm_engine, tokenizer=tokenizer, sampling=sampling)
    sp = SamplingParams(max_tokens=gen_len, forced_length=gen_len)

    def answer(request: Request):
        engine.add_request(request)
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == request.request_id:
                    return o
        raise RuntimeError(f"{request.request_id} never finished")

    whole = answer(Request("whole", RESUME_PROMPT, sp))
    engine.add_request(Request("cut", RESUME_PROMPT, sp))
    for _ in range(cut_steps):
        engine.step()
    part = engine.suspend("cut")
    if not part:
        return {
            "error": f"nothing to continue: the query had no tokens, or had finished, after {cut_steps} steps"
        }
    rest = answer(Request("rest", RESUME_PROMPT, sp, resume=part))
    pairs = zip(whole.token_ids, rest.token_ids, strict=False)
    return {
        "cut_tokens": len(part),
        "ids_equal": whole.token_ids == rest.token_ids,
        "text_equal": whole.text == rest.text,
        "first_difference": next((i for i, (a, b) in enumerate(pairs) if a != b), None),
        "completion_tokens": [whole.completion_tokens, rest.completion_tokens],
        "prompt_tokens": [whole.prompt_tokens, rest.prompt_tokens],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--served-model", required=True)
    p.add_argument("--plan", required=True)
    p.add_argument("--workload", default="{}", help="Workload fields as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gpu-check: %(message)s", stream=sys.stderr)
    w = Workload(**json.loads(args.workload))
    s: dict[str, Any] = {}
    try:
        import torch

        s = translate(args.plan, args.served_model, w, torch.cuda.device_count())
        out = run(args.served_model, w, s)
    except Exception as e:  # reported in the JSON: the check's job is to say what broke
        log.exception("vllm check failed")
        out = {"status": "failed", "error": f"{type(e).__name__}: {e}", **described(s)}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
