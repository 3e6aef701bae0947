"""`fleetbatch loadgen openai-check --files s3://...` (issue 50's must-show): the OpenAI batch flow with the
``openai`` client against `fleetbatch gateway up` whose HTTP front keeps its files in a real S3 server process
(moto's, :mod:`tests.s3_server`): every output line valid, as on a directory."""

from __future__ import annotations

import json
import subprocess
import sys

from gateway.http_api.format import COMPLETIONS
from gateway.http_api.s3_files import S3FileStore
from tests.harness import REPO


def test_openai_check_on_object_storage(tmp_path, s3_files):
    cmd = [sys.executable, "-m", "load.cli", "openai-check", "-n", "12", "--dataset", "generated",
           "--max-tokens", "16", "--endpoint", COMPLETIONS, "--run-dir", str(tmp_path / "run"),
           "--files", s3_files, "--gateway-arg=--num-clusters", "--gateway-arg=2"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)  # AWS_* from s3_files
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["requests"] == result["completed"] == result["output_lines_valid"] == 12, result
    assert result["status"] == result["grpc_status"] == "completed" and result["problems"] == []
    assert result["missing"] == result["duplicates"] == result["error_lines"] == 0
    assert result["files"] == s3_files
    stored = {f.purpose for f in S3FileStore(s3_files).files()}  # the input and the output, in the bucket
    assert stored == {"batch", "batch_output"}
    assert f"files in {s3_files}" in (tmp_path / "run" / "up.log").read_text()
