#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default: `gateway up`
# (embedded Redis, three engines of different speeds, the gateway) plus a sample
# generated batch, then print the per-cluster summary and stop everything.
# Response lengths are predicted by the learned model shipped in predictor/shipped_model/
# (pass `--predictor heuristic` or `--predictor DIR` to choose another).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/loadgen demo -n "${DEMO_QUERIES:-200}" "$@"
