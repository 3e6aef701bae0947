"""`scripts/gpu-check.sh` (engines.bench.gpu_check): its CPU dry run for real, and its answer on a machine without CUDA.

The GPU runs themselves need a GPU machine (see docs/design/engine.md); here the dry run drives check
A's code on the CPU (a real 2-stage pipeline over gloo, compared token for token with one
process), check B's plan translation and check C (the endpoint backend against a real
``transformers serve`` on the CPU, 4 requests of 4 tokens), and the script's JSON is read back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engines.bench.gpu_check import CHECKS, REPO, check_names, run_check, version
from engines.bench.gpu_check_endpoint import SITE_ENV, missing
from engines.bench.gpu_check_native import first_mismatch
from engines.bench.gpu_check_setup import Workload, uneven_cuts, write_plan
from engines.bench.gpu_check_vllm import PARTITION_ENV, translate


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_cpu_dry_run_runs_check_a_and_translates_for_check_b():
    r = subprocess.run(
        # check C (the endpoint backend against transformers serve) is left out for the suite's time: its
        # engine and server are tested in tests/test_endpoint_backend.py; by hand, `--cpu-dry-run` runs it too
        [sys.executable, "-m", "engines.bench.gpu_check", "--cpu-dry-run", "--checks", "native,vllm"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = last_json(r.stdout)
    assert out["dry_run"] is True and out["ok"] is True and out["missing"] == []
    native = out["checks"]["native"]
    assert native["status"] == "ran" and native["device"] == "cpu"
    for run in (native["one_process"], native["two_stage"]):
        assert run["status"] == "ran", run
        assert run["greedy_identical_to_cpu"] is True and run["matching_prompts"] == "2/2"
        assert run["tokens"] == 4 * 4 and run["tokens_per_s"] > 0
    assert native["two_stage"]["stages"] == 2 and native["two_stage"]["layers"] == [[0, 1], [1, 4]]
    assert native["two_stage"]["backend"] == "gloo"
    vllm = out["checks"]["vllm"]
    assert vllm["status"] == "skipped" and vllm["reason"] == "CPU dry run"
    assert vllm["translated"]["pipeline_parallel_size"] == 2
    assert vllm["translated"][PARTITION_ENV] == "1,3"
    assert out["checks"]["endpoint"] == {"status": "skipped", "reason": "not chosen (--checks)"}
    assert out["endpoint_missing"] == []


def test_script_without_cuda_says_so_and_exits_0():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    r = subprocess.run(
        ["bash", "scripts/gpu-check.sh"], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = last_json(r.stdout)
    assert out["cuda"] is False and out["ok"] is True
    assert out["checks"]["native"] == {"status": "skipped", "reason": "no CUDA"}
    assert out["checks"]["vllm"] == {"status": "skipped", "reason": "no CUDA"}
    assert out["checks"]["endpoint"] == {"status": "skipped", "reason": "no CUDA"}
    assert out["torch"] != "not installed" and "vllm" in out


def test_one_gpu_runs_the_translated_plan_without_pipeline_parallelism(tmp_path: Path):
    w = Workload(size="small")
    plan = tmp_path / "plan.json"
    write_plan(plan, w, vocab=2000)
    one = translate(str(plan), "/models/m", w, gpus=1)
    assert one["translated"]["pipeline_parallel_size"] == 2
    assert one["translated"][PARTITION_ENV] == "3,5"  # uneven: 3 + 5 of llama:small's 8 layers
    assert one["pp_skipped"] == "one GPU"
    assert one["engine_args"]["pipeline_parallel_size"] == 1 and one["env"] == {}
    two = translate(str(plan), "/models/m", w, gpus=2)
    assert "pp_skipped" not in two
    assert two["engine_args"]["pipeline_parallel_size"] == 2 and two["env"] == {PARTITION_ENV: "3,5"}


def test_uneven_cuts_and_mismatch_positions():
    assert uneven_cuts(8) == [0, 3, 8] and uneven_cuts(4) == [0, 1, 4]
    assert first_mismatch([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == {"prompt": 1, "position": 1}
    assert first_mismatch([[1, 2]], [[1, 2]]) is None


def test_a_check_that_hangs_or_prints_no_json_is_a_failure_not_a_crash():
    hung = run_check("timeit", ["-n", "1", "-r", "1", "import time; time.sleep(120)"], timeout_s=2)
    assert hung["status"] == "failed" and "timed out after 2 s" in hung["error"]
    noisy = run_check("timeit", ["-n", "1", "-r", "1", "pass"], timeout_s=60)
    assert noisy["status"] == "failed" and "without a JSON line" in noisy["error"]
    assert version("no_such_package_for_gpu_check") is None


def test_checks_are_chosen_by_name_and_missing_serving_packages_are_named():
    assert check_names("endpoint") == ["endpoint"] and check_names("native, vllm") == ["native", "vllm"]
    assert CHECKS == ("native", "vllm", "endpoint")
    with pytest.raises(argparse.ArgumentTypeError, match="checks are native, vllm, endpoint"):
        check_names("native,sglang")
    assert missing() == []  # this machine has transformers' serving extra


def test_a_carried_site_fills_gaps_at_the_end_of_sys_path(tmp_path: Path, monkeypatch):
    site = tmp_path / "gpu-check-site"
    site.mkdir()
    (site / "carried_probe_for_gpu_check.py").write_text(
        "import json, sys\n"
        "here = [i for i, p in enumerate(sys.path) if p.endswith('gpu-check-site')]\n"
        "print(json.dumps({'status': 'ran', 'index': here, 'after_site_packages': here[0] > max("
        "i for i, p in enumerate(sys.path) if p.endswith('site-packages'))}))\n"
    )
    monkeypatch.setenv(SITE_ENV, str(site))
    out = run_check("carried_probe_for_gpu_check", [], timeout_s=60)
    assert out["status"] == "ran" and len(out["index"]) == 1 and out["after_site_packages"] is True
