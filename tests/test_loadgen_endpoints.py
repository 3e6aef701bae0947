"""`fleetbatch loadgen endpoints`, tiny: 8 real chat rows at fixed concurrencies 1 and 2 straight to a real
``transformers serve``, then through a real gateway and endpoint engine with the server killed by its pid
and started again mid-batch; every key is there, every row back once, none failed, the gateway's prompt
counts the server's (no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.endpoint_server import chat_model_dir
from tests.harness import REPO

# the worker that runs tests/test_endpoint_backend.py: its chat model is built already
pytestmark = pytest.mark.xdist_group("endpoint-server")

KEYS = {
    "endpoint_efficiency", "best_fixed_concurrency", "fixed", "prompt_count_mismatches", "rows", "lost",
    "duplicated", "failed", "server_kills_survived", "endpoint_tokens_per_s",
}  # fmt: skip


def test_loadgen_endpoints_survives_a_killed_server_and_counts_prompts_as_the_server(
    data_root, tmp_path_factory, tmp_path
):
    model = chat_model_dir(tmp_path_factory)
    cmd = [
        sys.executable, "-m", "load.cli", "endpoints", "-n", "8", "--concurrency", "1,2", "--max-tokens", "8",
        "--served-model", str(model), "--kill-server", "--kill-at", "0.25", "--run-dir", str(tmp_path / "run"),
        "--no-progress",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert KEYS <= set(result), sorted(KEYS - set(result))
    assert result["rows"] == 8 and set(result["fixed"]) == {"1", "2"}
    assert result["best_fixed_concurrency"] in (1, 2) and result["endpoint_efficiency"] > 0
    assert (result["lost"], result["duplicated"], result["failed"], result["prompt_count_mismatches"]) == (
        0, 0, 0, 0,
    )  # fmt: skip
    assert result["server_kills_survived"] >= 1 and result["ok"] is True
    assert "killed the server" in out.stderr and "the server answers again" in out.stderr
