#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, on four workers (pytest-xdist; FLEETBATCH_TEST_WORKERS=0: in one process).
# Four on two cores: the tests use about 415 of the two cores' 700 CPU-s; the rest of the time they wait on processes,
# sockets and deliberate outages, which the extra workers fill (fresh clone: 344 s of test time, 354-369 s on three).
# The longest modules first (tests/durations.json, tests/conftest.py); a module marked with an xdist_group (one that
# starts an expensive server for its tests) runs on one worker (--dist loadgroup), the other tests one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers=${FLEETBATCH_TEST_WORKERS:-4}
dist=()
if [ "$workers" != 0 ]; then dist=(-n "$workers" --dist loadgroup --no-loadscope-reorder); fi
exec .venv/bin/python -m pytest -q "${dist[@]}" --durations=15 "$@"   # the slowest tests, to keep CI under its 20 minutes
