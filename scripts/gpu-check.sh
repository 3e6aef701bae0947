#!/usr/bin/env bash
# The checks for a GPU machine (issue 32): the native engine on CUDA (one process and a 2-stage
# plan) and vLLM with a plan translated into pipeline_parallel_size / VLLM_PP_LAYER_PARTITION.
# Progress goes to stderr; the last line of stdout is one JSON object. Without CUDA it says
# "cuda": false and exits 0. It installs nothing (the GPU machine has no network): it uses
# .venv/bin/python when present, else $PYTHON, else python3, and reports what is missing.
#   bash scripts/gpu-check.sh                 # on the GPU machine
#   bash scripts/gpu-check.sh --cpu-dry-run   # check A's code on this CPU, tiny model
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
