#!/usr/bin/env bash
# Set up everything fleetbatch needs on a fresh machine (idempotent):
# a redis-server binary, a virtualenv in .venv, the CPU build of torch 2.13.0,
# the project with its test extras, and the caches a run reads (`fleetbatch gateway prepare`).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x /usr/bin/redis-server ] && [ ! -x /usr/local/bin/redis-server ] && [ -z "${FLEETBATCH_REDIS_SERVER:-}" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing redis-server (Debian package)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "setup: please install redis-server (e.g. 'sudo apt-get install redis-server') or set FLEETBATCH_REDIS_SERVER" >&2
    exit 1
  fi
fi

# Debian's chromium and its driver: the status page is tested in a real headless browser
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing chromium and chromium-driver (Debian packages, for the status page's test)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "setup: chromium and chromium-driver are missing: the status page's test is skipped (fails under CI)" >&2
  fi
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PY"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch 2.13.0 (CPU build)"
  .venv/bin/python -m pip install -q torch==2.13.0
fi
echo "setup: installing fleetbatch with its test extras"
.venv/bin/python -m pip install -q -e ".[test]"
# the caches a run reads (the default tokenizer, this CPU's profile, matplotlib's fonts), built here once,
# never by surprise in the middle of a run or by several test workers at once
echo "setup: building the caches (fleetbatch gateway prepare: \$FLEETBATCH_CACHE=${FLEETBATCH_CACHE:-~/.cache/fleetbatch})"
.venv/bin/fleetbatch gateway prepare >/dev/null
# the bytecode every process imports, compiled once here rather than by every process that starts at once
.venv/bin/python -m compileall -q -j 0 -x '(^|/)(\.venv|site|runs)/' . >/dev/null
echo "setup: done (activate with: . .venv/bin/activate)"
