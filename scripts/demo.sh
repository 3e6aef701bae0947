#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default: `fleetbatch gateway up`
# (embedded Redis, three engines of different speeds, the gateway) plus a sample
# batch: real prompts of the mixed workload with their recorded lengths where the data
# directory exists ($FLEETBATCH_DATA or ../shared/data), else the generated mix; then
# print the per-cluster summary (predicted against actual tokens) and stop everything.
# Response lengths are predicted by the learned model shipped in predictor/shipped_model/
# (pass `--predictor heuristic` or `--predictor DIR` to choose another).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/fleetbatch loadgen demo -n "${DEMO_QUERIES:-200}" "$@"
