#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, on three workers (pytest-xdist; FLEETBATCH_TEST_WORKERS=0: in one process).
# Three on two cores: the suite waits on processes and sockets for about a fifth of its time, which a third worker fills.
# Each worker takes one test at a time, the longest modules first (tests/durations.json, tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers=${FLEETBATCH_TEST_WORKERS:-3}
dist=()
if [ "$workers" != 0 ]; then dist=(-n "$workers" --dist load --maxschedchunk 1); fi
exec .venv/bin/python -m pytest -q "${dist[@]}" --durations=15 "$@"   # the slowest tests, to keep CI under its 20 minutes
