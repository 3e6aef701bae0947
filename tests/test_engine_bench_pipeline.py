"""``fleetbatch engine bench --stages``: the planner lays the model out, the stages run, one JSON object comes last;
stage metrics reach Prometheus."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from prometheus_client import generate_latest

from engines.bench.pipeline import latency_error, listed_order_plan, slowdowns_from_speeds
from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from engines.metrics import StageCollector
from engines.plan import plan_stages
from tests import harness
from tests.harness import REPO
from tests.harness import write_plan as harness_plan
from tests.test_engine_pipeline import write_plan


def test_speeds_become_slowdowns():
    assert slowdowns_from_speeds([1, 2]) == [1.0, 0.0]  # the first is half as fast: it sleeps 1x its compute
    assert slowdowns_from_speeds([1, 2, 4]) == [3.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="positive"):
        slowdowns_from_speeds([1, 0])


def test_latency_error_is_the_mean_relative_error():
    run = {
        "stages": [
            {"decode_latency_ms": 11.0, "predicted_decode_ms": 10.0},
            {"decode_latency_ms": 7.0, "predicted_decode_ms": 10.0},
        ]
    }
    assert latency_error(run) == pytest.approx(0.2)


@pytest.mark.slow
def test_bench_stages_prints_the_figures(data_root):
    cmd = [
        sys.executable,
        "-m",
        "engines.cli",
        "bench",
        "--stages",
        "2",
        "--stage-speeds",
        "1,2",
        "--size",
        "nano",
    ]
    cmd += ["--num-queries", "8", "--prompt-len", "16", "--gen-len", "8", "--repeats", "1"]
    cmd += [
        "--profile-reps",
        "1",
        "--profile-min-time",
        "0.001",
        "--profile-batches",
        "1,4",
    ]  # not under test
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("stages", "tokens_per_s", "speedup_vs_one_process", "stage_latency_error", "bubble_fraction"):
        assert key in out
    assert out["stages"] == 2 and "speedup_vs_even_partition" in out
    assert sorted(out["stage_slowdowns"]) == [0.0, 1.0]
    assert out["planned"]["tokens"] == out["one_process"]["tokens"] == out["even"]["tokens"] == 8 * 8
    slow = next(s for s in out["planned"]["stages"] if s["slowdown"] == 1.0)
    assert slow["emulated_s"] > 0 and 0 <= out["bubble_fraction"] < 1


def test_stage_metrics_are_exported(tmp_path):
    from localmodels import build_model, default_tokenizer, generated_corpus

    tok = default_tokenizer(vocab_size=1024, texts=generated_corpus(400))
    model = build_model("llama", "tiny", tokenizer=tok, seed=3)
    plan = write_plan(tmp_path / "plan.json", [0, 1, 4], slowdowns=[0.0, 0.5])
    engine = LLMEngine.build(model, tok, EngineConfig(plan_path=str(plan)))
    try:
        engine.generate([Request(f"r{i}", "hello there", SamplingParams(forced_length=5)) for i in range(3)])
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
        registry.register(StageCollector(engine))
        text = generate_latest(registry).decode()
    finally:
        engine.close()
    assert 'fleetbatch_stage_compute_seconds_total{device="CPU@x1.5",layers="1-4",stage="1"}' in text
    emulated = [
        line for line in text.splitlines() if line.startswith("fleetbatch_stage_emulated_seconds_total")
    ]
    assert float(emulated[1].split()[-1]) > 0 and float(emulated[0].split()[-1]) == 0
    assert (
        "fleetbatch_stage_memory_bytes" in text
        and "fleetbatch_stage_predicted_decode_latency_seconds" in text
    )


def test_engine_profile_writes_a_profile_the_planner_plans_from(tmp_path):
    from engines.cli import main as engine_main
    from planfile import load_plan
    from planner.cli import main as planner_main
    from planner.latency import Profile, fit_profile

    prof = tmp_path / "profile.json"
    argv = ["profile", "--size", "nano", "--batches", "1,4,8", "--lengths", "16,32"]
    argv += ["--prefill-batches", "1,2,4", "--reps", "1", "--min-time", "0.001", "--out", str(prof)]
    assert engine_main(argv) == 0
    p = Profile.load(prof)
    assert p.source == "measured (engine)" and len(p.samples[16]["decode"]) == 6
    lm = fit_profile(p)
    assert lm.decode_s(16, 8, 32) >= lm.decode_s(16, 1, 16) > 0 and lm.head_s(8) > 0  # fitted: no timing race
    driver = p.samples[16]["driver"]  # the engine's own work per decode micro-batch (real scheduler)
    assert [v for v, *_ in driver] == [1, 4, 8] and all(t > 0 for *_, t in driver)
    assert lm.driver_s(8) > 0
    spec = tmp_path / "cluster.yaml"
    spec.write_text("nodes:\n  - name: box\n    devices: [{type: CPU, count: 3}]\n")
    plan = tmp_path / "plan.json"
    argv = [
        "plan",
        "--cluster-spec",
        str(spec),
        "--shape",
        "llama:nano",
        "--profile",
        f"CPU={prof}",
        "--bits",
        "16",
    ]
    argv += [
        "--tp-sizes",
        "1",
        "--stages",
        "2",
        "--batch-size",
        "8",
        "--prompt-len",
        "16",
        "--output-tokens",
        "8",
    ]
    assert planner_main([*argv, "--out", str(plan), "--time-limit", "2"]) == 0
    assert len(load_plan(plan).stages) == 2  # exactly the stages asked for, though 1 or 3 could be planned


def test_merged_profile_is_the_mean_of_concurrent_ones():
    from engines.bench.profile import merge_profiles

    def doc(t):
        return {"meta": {"wall_s": t}, "samples": {"16": {"decode": [[1, 16, t], [2, 16, 2 * t]]}}}

    m = merge_profiles([doc(1.0), doc(3.0)])
    assert m["samples"]["16"]["decode"] == [[1, 16, 2.0], [2, 16, 4.0]]
    assert m["meta"] == {"wall_s": 3.0, "concurrent": 2}


def test_bench_runs_a_given_plan(tmp_path, data_root, capsys):
    """``fleetbatch engine bench --plan`` (documented in docs/design/engine.md) crashed with a TypeError without --stages."""
    plan = harness_plan(
        tmp_path / "plan.json", "nano", [0, 1, 2], [16, 16], decode_mb=4, prefill_mb=2, head_split=0.5
    )
    base = [sys.executable, "-m", "engines.cli", "bench", "--plan", str(plan), "--size", "nano"]
    small = ["--num-queries", "8", "--prompt-len", "16", "--gen-len", "8", "--repeats", "1"]
    r = subprocess.run(base + small, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["stages"] == 2 and out["layers"] == [[0, 1], [1, 2]] and out["decode_micro_batch"] == 4
    # the plan shares the LM head: the same plan with the head on the last stage runs beside it
    assert out["head_split"] == 0.5 and out["speedup_vs_head_on_last"] > 0
    assert out["head_on_last"]["tokens"] == out["planned"]["tokens"] == 8 * 8
    assert out["planned"]["stages"][0]["predicted_decode_ms"] is not None
    assert out["head_on_last"]["stages"][0]["predicted_decode_ms"] is None  # not the plan's prediction
    from engines.cli import main as engine_main  # the refusal comes before any work: no process needed

    assert engine_main(base[3:] + small + ["--stage-speeds", "1,2"]) != 0
    assert "--stage-speeds goes with --stages" in capsys.readouterr().err


def test_listed_order_plan_splits_evenly_in_the_clusters_order(tmp_path):
    """A plan that ordered the devices otherwise than ``--stage-speeds`` listed them gets an even split
    in the listed order too (the hand-made layout), a valid plan file the engine runs; a plan in
    listed order needs none."""
    path = harness.write_plan(tmp_path / "plan.json", "tiny", [0, 3, 4], [8, 4, 16, 8], slowdowns=[0.0, 1.0])
    doc = json.loads(path.read_text())
    assert listed_order_plan(doc, [0.0, 1.0], tmp_path / "same.json") is None
    doc["head_split"] = 0.3  # the planner ran the fast device (0) first; the cluster lists the slow one first
    listed = listed_order_plan(doc, [1.0, 0.0], tmp_path / "listed.json")
    stages = plan_stages(str(listed), 4, even_split=True)
    assert [(s.layer_start, s.layer_end, s.slowdown) for s in stages] == [(0, 2, 1.0), (2, 4, 0.0)]
    again = json.loads(listed.read_text())
    assert [st["device_index"] for st in again["stages"]] == [1, 0] and again["head_split"] == 0.0
    assert [b for st in again["stages"] for b in st["bits"]] == [8, 4, 16, 8]  # the layers' own bits
