#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, on two workers (pytest-xdist; FLEETBATCH_TEST_WORKERS=0: in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers=${FLEETBATCH_TEST_WORKERS:-2}
exec .venv/bin/python -m pytest -q -n "$workers" --durations=15 "$@"   # the slowest tests, to keep CI under its 20 minutes
