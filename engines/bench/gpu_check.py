"""``bash scripts/gpu-check.sh``: the checks to run when a GPU machine is at hand; one JSON line at the end.

1. Probe what this machine has: Python, torch (its CUDA, the GPU count and name), transformers,
   vLLM. A package is looked up before it is imported, so a machine without one says which is
   missing in the JSON instead of failing on an import (the GPU machine has what its image has,
   and nothing can be installed there). That is why this module imports torch and the model
   code inside functions.
2. Without CUDA (and without ``--cpu-dry-run``) nothing heavy runs: ``"cuda": false``, both
   checks ``skipped``, exit 0.
3. Otherwise build a random llama (:mod:`engines.bench.gpu_check_setup`) and an uneven 2-stage plan
   for it in a temporary directory, then run each check in its own process, under a time limit
   (a hung NCCL or vLLM start cannot eat the machine's lease: its process group is killed):
   check A, :mod:`engines.bench.gpu_check_native` (the native engine on the device, one process and
   2 stages, tokens/s and greedy equality with the CPU), and check B,
   :mod:`engines.bench.gpu_check_vllm` (vLLM with the plan's ``pipeline_parallel_size`` and
   ``VLLM_PP_LAYER_PARTITION``; only the translation where vLLM or CUDA is missing), and check C,
   :mod:`engines.bench.gpu_check_endpoint` (the endpoint backend in front of ``transformers serve``
   on the device: tokens/s, and the server's prompt-token counts against the gateway's rule;
   ``skipped`` with the missing packages where the ``serving`` extra is not here).
   ``--checks`` chooses among ``native``, ``vllm`` and ``endpoint`` (default: all three).

Packages the GPU machine lacks may be carried in the working tree (``build/gpu-check-site``, made by
``pip install --target``; or ``$FLEETBATCH_GPU_CHECK_SITE``): every check's process appends it to its
``sys.path`` (:func:`engines.bench.gpu_check_endpoint.launch`), so it fills gaps and shadows nothing.

``--cpu-dry-run`` runs check A's code on the CPU with the tiny model and a few tokens, and of
check B only the translation, and check C with a tiny model, 4 requests of 4 tokens, on the CPU (the
test suite runs it). Each check says ``ran``, ``skipped`` (with a reason) or ``failed`` (with the
error); the exit status is 1 when one failed, else 0. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import signal
import site
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from engines.bench.gpu_check_endpoint import SITE_ENV, carried_site, launch
from engines.bench.gpu_check_endpoint import missing as endpoint_missing

log = logging.getLogger("gpu-check")

REPO = Path(__file__).resolve().parents[2]
#: what the checks import (the engine, the model code); vllm is optional (check B only)
REQUIRED = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "tqdm")
CHECKS = ("native", "vllm", "endpoint")


def version(package: str) -> str | None:
    """The installed version of ``package``, None when it is not importable here."""
    if importlib.util.find_spec(package) is None:
        return None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def probe() -> dict[str, Any]:
    """What this machine has, without importing anything that is missing."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": version("torch") or "not installed",
        "transformers": version("transformers") or "not installed",
        "vllm": version("vllm") or "not installed",
        "missing": [p for p in REQUIRED if version(p) is None],
        "endpoint_missing": endpoint_missing(),  # transformers serve's `serving` extra, the backend's httpx
        "carried_site": os.environ.get(SITE_ENV),
        "cuda": False,
        "gpu_count": 0,
    }
    if version("torch") is not None:
        import torch

        info["cuda"] = torch.cuda.is_available()
        if info["cuda"]:
            info["gpu_count"] = torch.cuda.device_count()
            info["device_name"] = torch.cuda.get_device_name(0)
            info["torch_cuda"] = torch.version.cuda
    return info


def run_check(module: str, argv: list[str], timeout_s: float) -> dict[str, Any]:
    """``python -m module argv`` in its own process group; its last stdout line as JSON, or a failure."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    )
    t0 = time.monotonic()
    proc = subprocess.Popen(
        launch(module, *argv),  # python -m module, with the carried site appended to sys.path
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        process_group=0,  # its own group (same session): its stage / vLLM / server processes go with os.killpg
    )
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"status": "failed", "error": f"timed out after {timeout_s:.0f} s (process group killed)"}
    except BaseException:  # interrupted: leave nothing of the check behind
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    lines = out.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict):
        return {"status": "failed", "error": f"{module} exited {proc.returncode} without a JSON line"}
    result["check_s"] = round(time.monotonic() - t0, 1)
    return result


def skipped(reason: str, **more: Any) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason, **more}


def vllm_check(
    info: dict[str, Any], model_dir: Path, plan: Path, w, timeout_s: float, dry_run: bool
) -> dict[str, Any]:
    from engines.bench.gpu_check_vllm import described, translate

    why = None
    if dry_run:
        why = "CPU dry run"
    elif info["vllm"] == "not installed":
        why = "vllm not installed"
    elif not info["cuda"]:
        why = "no CUDA"
    if why:
        return skipped(why, **described(translate(str(plan), str(model_dir), w, info["gpu_count"])))
    if timeout_s < 30:
        return skipped(f"no time left ({timeout_s:.0f} s of the budget)")
    argv = ["--served-model", str(model_dir), "--plan", str(plan), "--workload", json.dumps(w.to_dict())]
    return run_check("engines.bench.gpu_check_vllm", argv, timeout_s)


def endpoint_check(info: dict[str, Any], tmp: Path, w, device: str, timeout_s: float, args) -> dict[str, Any]:
    if info["endpoint_missing"]:
        return skipped("missing: " + ", ".join(info["endpoint_missing"]), device=device)
    if timeout_s < 30:
        return skipped(f"no time left ({timeout_s:.0f} s of the budget)")
    workload = {"size": w.size, "queries": w.queries, "gen_len": w.gen_len}
    argv = ["--workdir", str(tmp), "--device", device, "--workload", json.dumps(workload)]
    argv += [f"--serve-arg={a}" for a in args.endpoint_serve_arg]
    argv += ["--start-timeout-s", str(max(10.0, timeout_s - 10))]
    return run_check("engines.bench.gpu_check_endpoint", argv, timeout_s)


def run_checks(info: dict[str, Any], args) -> dict[str, Any]:
    """The chosen checks one after the other, each in its own process under its time limit, in the budget."""
    from engines.bench.gpu_check_setup import DRY_RUN, Workload, prepare

    w = DRY_RUN if args.cpu_dry_run else Workload()
    w = replace(w, **{k: v for k, v in (("size", args.size), ("queries", args.num_queries)) if v})
    device = "cpu" if args.cpu_dry_run else "cuda"
    chosen = set(args.checks)
    out = {k: skipped("not chosen (--checks)") for k in CHECKS if k not in chosen}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fleetbatch-gpu-check-") as name:
        tmp = Path(name)
        if chosen & {"native", "vllm"}:
            log.info("building llama:%s (random weights) and an uneven 2-stage plan in %s", w.size, tmp)
            model_dir, plan = prepare(tmp, w)
        if "native" in chosen:
            argv = ["--served-model", str(model_dir), "--plan", str(plan), "--device", device]
            argv += ["--workload", json.dumps(w.to_dict())]
            log.info("check A: the native engine on %s", device)
            out["native"] = run_check("engines.bench.gpu_check_native", argv, args.native_timeout_s)
            log.info("check A: %s", out["native"]["status"])
        if "vllm" in chosen:
            log.info("check B: vLLM with the translated plan")
            timeout = min(args.vllm_timeout_s, args.budget_s - (time.monotonic() - t0))
            out["vllm"] = vllm_check(info, model_dir, plan, w, timeout, args.cpu_dry_run)
            log.info("check B: %s", out["vllm"]["status"])
        if "endpoint" in chosen:
            log.info("check C: the endpoint backend against transformers serve on %s", device)
            timeout = min(args.endpoint_timeout_s, args.budget_s - (time.monotonic() - t0))
            out["endpoint"] = endpoint_check(info, tmp, w, device, timeout, args)
            log.info("check C: %s", out["endpoint"]["status"])
    return {k: out[k] for k in CHECKS}


def check_names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"checks are {', '.join(CHECKS)}; got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-dry-run", action="store_true", help="run check A's code on the CPU, tiny model")
    p.add_argument("--size", choices=("tiny", "small", "base"), help="model size (default small; tiny dry)")
    p.add_argument("-n", "--num-queries", type=int, help="queries per timed run (default 64; 4 dry)")
    p.add_argument("--native-timeout-s", type=float, default=120.0)
    p.add_argument("--vllm-timeout-s", type=float, default=150.0)
    p.add_argument("--endpoint-timeout-s", type=float, default=150.0)
    p.add_argument(
        "--endpoint-serve-arg",
        action="append",
        default=[],
        help="an argument for check C's transformers serve (repeatable), e.g. --continuous-batching",
    )
    p.add_argument("--checks", type=check_names, default=list(CHECKS), help="comma-separated (default: all)")
    p.add_argument("--budget-s", type=float, default=400.0, help="the checks together, at most")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gpu-check: %(message)s", stream=sys.stderr)
    t0 = time.monotonic()
    site_dir = carried_site()
    if site_dir is not None:  # fills gaps only: appended to sys.path here and in every check's process
        os.environ[SITE_ENV] = str(site_dir)
        site.addsitedir(str(site_dir))
    info = probe()
    log.info("probe: %s", info)
    out: dict[str, Any] = {"gpu_check": "issue 32", "dry_run": args.cpu_dry_run, **info}
    if info["missing"]:
        reason = "missing: " + ", ".join(info["missing"])
        out["checks"] = {k: skipped(reason) for k in CHECKS}
    elif not info["cuda"] and not args.cpu_dry_run:
        out["checks"] = {k: skipped("no CUDA") for k in CHECKS}
    else:
        out["checks"] = run_checks(info, args)
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    failed = [k for k, c in out["checks"].items() if c["status"] == "failed"]
    out["ok"] = not failed
    print(json.dumps(out), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
