#!/usr/bin/env bash
# The checks for a GPU machine (issues 32, 47): the native engine on CUDA (one process and a 2-stage
# plan), vLLM with a plan translated into pipeline_parallel_size / VLLM_PP_LAYER_PARTITION, and the
# endpoint backend against `transformers serve` on the GPU (--checks native,vllm,endpoint chooses).
# Progress goes to stderr; the last line of stdout is one JSON object. Without CUDA it says
# "cuda": false and exits 0. It installs nothing (the GPU machine has no network): it uses
# .venv/bin/python when present, else $PYTHON, else python3, and reports what is missing.
# Packages the machine lacks may be carried in the working tree as build/gpu-check-site (made here with
# `pip install --target build/gpu-check-site --python-version X.Y --only-binary=:all: ...`; or named by
# $FLEETBATCH_GPU_CHECK_SITE): the checks append it to sys.path, after the machine's own packages.
#   bash scripts/gpu-check.sh                 # on the GPU machine
#   bash scripts/gpu-check.sh --cpu-dry-run   # checks A and C's code on this CPU, tiny models
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=${PYTHON:-python3}
fi
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu-check: no Python interpreter ($PY)" >&2
    echo '{"gpu_check": "issue 32", "cuda": false, "ok": false, "error": "no python3"}'
    exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PY" -m engines.bench.gpu_check "$@"
