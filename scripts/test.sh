#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, on four workers (pytest-xdist; FLEETBATCH_TEST_WORKERS=0: in one process).
# Four on two cores: the CPU is about 80 % busy over a run (sampled); the rest of the time the tests wait on processes,
# sockets and deliberate outages, which the extra workers fill (five workers were slower, six much slower).
# The longest modules first (tests/durations.json, tests/conftest.py); a module marked with an xdist_group (one that
# starts an expensive server for its tests) runs on one worker (--dist loadgroup), the other tests one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# compiled modules are written (__pycache__, git-ignored) and read back: with PYTHONDONTWRITEBYTECODE set, as some
# environments set it, each of the four workers rewrote all ~300 test modules' asserts at collection (9.5 -> 15 s of
# CPU a worker) and every process the tests start compiled the project's modules anew; the results are the same
unset PYTHONDONTWRITEBYTECODE
# the whole suite: pytest's rewritten test modules written once here, not by the four workers at once (runs nothing)
if [ $# -eq 0 ]; then .venv/bin/python -m pytest -q --collect-only -p no:cacheprovider >/dev/null; fi
workers=${FLEETBATCH_TEST_WORKERS:-4}
dist=()
if [ "$workers" != 0 ]; then dist=(-n "$workers" --dist loadgroup --no-loadscope-reorder); fi
exec .venv/bin/python -m pytest -q "${dist[@]}" --durations=15 "$@"   # the slowest tests, to keep CI under its 20 minutes
