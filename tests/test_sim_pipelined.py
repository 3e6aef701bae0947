"""The simulator's planned clusters: a plan's pipeline in cost-model time, and ``sim validate`` on planned runs.

Hand-made plans whose devices take a constant time per layer per micro-batch give the exact
makespan a pipeline must have: one query goes through the stages one micro-batch at a time; two
queries in a two-stage pipeline (one decoding query per micro-batch) overlap, the slower stage
setting the pace. A synthetic ``fleetbatch loadgen study --planned`` run directory is read and replayed.
"""

from __future__ import annotations

import json
import math

import pytest

from engines.config import EngineConfig
from planfile import load_plan
from sim.cli import main
from sim.core import ClusterSpec, SimConfig, Simulator
from sim.costs import LinearCost
from sim.engines import IterationEngine
from sim.pipelined import PipelinedEngine
from sim.validate import read_run, validate
from sim.workload import Workload
from tests import harness


def cost(layer_s: float, head: list[float] | None = None) -> dict:
    """A device taking ``layer_s`` per layer for a micro-batch's prefills, as much for its decodes."""
    return {
        "prefill": {"16": [layer_s, 0, 0, 0, 0]},
        "decode": {"16": [layer_s, 0, 0, 0]},
        "head": head,
    }


def write_plan(
    path, cuts: list[int], costs: list[dict], mb: tuple[int, int] = (1, 1), head_split: float = 0.0
):
    """A plan of ``len(cuts) - 1`` stages (layers ``[cuts[k], cuts[k+1])`` at 16 bits), devices with ``costs``,
    ``mb`` = (prefill, decode) micro-batch sizes."""
    harness.write_plan(
        path,
        "nano",
        cuts,
        [16] * cuts[-1],
        decode_mb=mb[1],
        prefill_mb=mb[0],
        vocab=100,
        head_split=head_split,
    )
    plan = json.loads(path.read_text())
    for dev, c in zip(plan["devices"], costs, strict=True):
        dev["cost"] = c
    path.write_text(json.dumps(plan))
    return path


def makespan(plan, prompts: list[int], lengths: list[int]) -> float:
    n = len(prompts)
    work = Workload(prompts, lengths, [float(t) for t in lengths], [0.0] * n)
    spec = ClusterSpec("c", backend="pipelined", plan=str(plan))
    return Simulator([spec], work, SimConfig(policy="token", offload=False)).run().makespan_s


def test_one_query_goes_through_the_stages_one_micro_batch_at_a_time(tmp_path):
    # 2 stages: 3 layers at 0.01 s, 1 layer at 0.05 s; a lone query's T micro-batches (its prefill, then
    # T - 1 decodes) each pass both stages before the next is formed: T * (0.03 + 0.05)
    plan = write_plan(tmp_path / "p.json", [0, 3, 4], [cost(0.01), cost(0.05)])
    assert makespan(plan, [20], [7]) == pytest.approx(7 * 0.08)


def test_two_queries_overlap_and_the_slower_stage_sets_the_pace(tmp_path):
    # stage 0 a = 0.02 s, stage 1 b = 0.05 s; one query per micro-batch (micro-batches of 1), so
    # max_running = 2 and the two queries alternate: while one is on stage 1 the other is on
    # stage 0. Query 0's k-th token comes back at a + (2k - 1) b, query 1's at a + 2 k b.
    a, b, T = 0.02, 0.05, 6
    plan = write_plan(tmp_path / "p.json", [0, 1, 2], [cost(a), cost(b)])
    assert makespan(plan, [10, 12], [T, T]) == pytest.approx(a + 2 * T * b)
    # one stage at a + b per layer pair does not overlap: 2 queries x T micro-batches
    one = write_plan(tmp_path / "one.json", [0, 2], [cost((a + b) / 2)], mb=(1, 1))
    assert makespan(one, [10, 12], [T, T]) == pytest.approx(2 * T * (a + b))


def test_a_one_stage_micro_batch_charges_its_layers_and_the_whole_head(tmp_path):
    # micro-batches of 2: both queries prefill together, then decode together; per micro-batch
    # 2 layers x 0.01 s + the head over its 2 sampled rows (0.003 + 0.001 x 2)
    plan = write_plan(tmp_path / "p.json", [0, 2], [cost(0.01, [0.003, 0.001])], mb=(2, 2))
    assert makespan(plan, [10, 12], [5, 5]) == pytest.approx(5 * (0.02 + 0.005))


def test_a_head_split_charges_the_first_stage_when_the_micro_batch_is_back(tmp_path):
    # half the head's rows on stage 0 (after the last stage), half on the last stage: one row each
    # time costs 0.004 + 0.002 x 0.5 on both; a lone query: T x (0.01 + 0.02 + 2 x 0.005)
    head = [0.004, 0.002]
    plan = write_plan(tmp_path / "p.json", [0, 1, 2], [cost(0.01, head), cost(0.02, head)], head_split=0.5)
    assert makespan(plan, [9], [4]) == pytest.approx(4 * (0.01 + 0.02 + 2 * 0.005))


def test_the_plan_sets_the_engine_limits(tmp_path):
    plan = write_plan(tmp_path / "p.json", [0, 1, 2], [cost(0.01), cost(0.01)], mb=(3, 4))
    engine = PipelinedEngine(plan, EngineConfig(), Workload([], [], [], []))
    assert engine.config.max_running == 8  # decode micro-batch x stages (engines.plan.apply_plan)
    assert engine.config.prefill_micro_batch == 3 and engine.num_stages == 2


def test_a_stage_without_a_device_cost_is_refused(tmp_path):
    plan = write_plan(tmp_path / "p.json", [0, 1, 2], [cost(0.01), None])
    with pytest.raises(ValueError, match="no 'cost'"):
        makespan(plan, [5], [3])


def planned_run(root, name: str, plans: dict[str, str], rows: list[dict]) -> str:
    """A run directory as ``fleetbatch loadgen study --planned`` writes it: results, meta, clusters, plans."""
    run = root / name
    (run / "plans").mkdir(parents=True)
    clusters = {}
    for cluster, src in plans.items():
        dst = run / "plans" / f"{cluster}.json"
        dst.write_text(open(src).read())
        clusters[cluster] = {"plan": f"plans/{cluster}.json", "predicted_tokens_per_s": 1000.0}
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = {"policy": "token", "backend": "native", "planned": {"method": "ilp", "clusters": clusters}}
    (run / "meta.json").write_text(json.dumps(meta))
    yaml_rows = "".join(
        f"- name: {c}\n  capacity_tps: 1000.0\n  backend: native\n  plan: plans/{c}.json\n" for c in plans
    )
    (run / "clusters.yaml").write_text("version: 1\nclusters:\n" + yaml_rows)
    return str(run)


def result_rows(n: int, makespan_s: float) -> list[dict]:
    rows = []
    for i in range(n):
        rows.append(
            {
                "query_id": f"g{i:06d}",
                "cluster": "fast" if i % 2 else "slow",
                "prompt_tokens": 10 + i,
                "completion_tokens": 3 + i % 4,
                "predicted_tokens": 4.0 + i % 3,
                "timings": {"enqueued_at": 100.0, "finished_at": 100.0 + makespan_s * (i + 1) / n},
            }
        )
    return rows


def test_validate_replays_a_planned_run_on_its_plans(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(
        IterationEngine, "AUDIT", True
    )  # every free_slots shortcut checked against the real one
    fast = write_plan(tmp_path / "fast.json", [0, 1, 2], [cost(0.001), cost(0.002)], mb=(2, 2))
    slow = write_plan(tmp_path / "slow.json", [0, 2], [cost(0.004, [0.001, 0.0005])], mb=(2, 2))
    run = planned_run(tmp_path, "planned", {"fast": str(fast), "slow": str(slow)}, result_rows(12, 0.5))
    real = read_run(run)
    assert real.backend == "pipelined" and real.names == ["fast", "slow"]
    assert real.hints == [load_plan(fast).predicted_throughput_tokens_per_s] * 2  # the gateway's plan_tps
    assert real.makespan_s == pytest.approx(0.5)
    out = validate([run], LinearCost())
    assert out["fitted"] is False and math.isfinite(out["sim_makespan_error"])
    sim_s = out["runs"][0]["sim_makespan_s"]
    assert sim_s > 0 and out["sim_makespan_error"] == pytest.approx(abs(sim_s - 0.5) / 0.5, abs=0.02)
    assert main(["validate", run]) == 0  # the CLI: one planned run is enough (nothing is fitted)
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["sim_makespan_error"] == out["sim_makespan_error"]


def test_planned_and_unplanned_runs_are_not_validated_together(tmp_path):
    plan = write_plan(tmp_path / "p.json", [0, 2], [cost(0.004)])
    run = planned_run(tmp_path, "planned", {"fast": str(plan), "slow": str(plan)}, result_rows(4, 0.2))
    other = tmp_path / "other"
    other.mkdir()
    rows = result_rows(4, 0.2)
    (other / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (other / "meta.json").write_text(json.dumps({"policy": "token", "backend": "native", "fleet": [1, 2]}))
    (other / "clusters.yaml").write_text(
        "version: 1\nclusters:\n- name: slow\n  capacity_tps: 10\n  engine_args: []\n- name: fast\n  capacity_tps: 20\n  engine_args: []\n"
    )
    with pytest.raises(ValueError, match="apart"):
        validate([run, str(other)], LinearCost())


def recorded(scheduler) -> list[list[tuple[str, int, int]]]:
    """Every micro-batch ``scheduler`` forms from now on, as ``(query, start, tokens)`` per chunk."""
    seen: list[list[tuple[str, int, int]]] = []
    schedule = scheduler.schedule

    def spy(busy=frozenset()):
        out = schedule(busy)
        if out.chunks:
            seen.append([(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks])
        return out

    scheduler.schedule = spy
    return seen


def test_the_micro_batches_are_the_real_pipelined_engines(tmp_path):
    """The real engine with a 2-stage plan (stage processes, the nano model) and the simulated one
    form the same micro-batches in the same order: chunked prefills, one micro-batch per stage in
    flight, the plan's micro-batch limits, KV admission."""
    from engines.engine import LLMEngine
    from engines.interface import Request, SamplingParams
    from localmodels import build_model, default_tokenizer

    plan = write_plan(tmp_path / "p.json", [0, 1, 2], [cost(0.01), cost(0.01)], mb=(2, 2))
    # the prompts all open with the same ids and the simulated workload has no prefix groups: no cache
    config = EngineConfig(
        plan_path=str(plan), prefill_chunk=8, block_size=4, kv_budget_tokens=192, prefix_cache=False
    )
    prompts, lengths, predicted = [12, 5, 20, 7, 9, 3], [4, 9, 3, 6, 2, 5], [3, 8, 6, 6, 2, 9]
    tokenizer = default_tokenizer(vocab_size=1024)
    real = LLMEngine.build(build_model("llama", "nano", tokenizer=tokenizer, seed=5), tokenizer, config)
    try:
        real_batches = recorded(real.scheduler)
        requests = [
            Request(str(i), "", SamplingParams(max_tokens=16, forced_length=t), list(range(3, 3 + p)), pred)
            for i, (p, t, pred) in enumerate(zip(prompts, lengths, predicted, strict=True))
        ]
        outputs = real.generate(requests)
    finally:
        real.close()
    assert [o.completion_tokens for o in outputs] == lengths
    sim = PipelinedEngine(
        plan, config, Workload(prompts, lengths, [float(p) for p in predicted], [0.0] * 6), 16
    )
    sim_batches = recorded(sim.scheduler)
    for q in range(6):
        sim.add(q)
    while sim.has_unfinished():
        assert sim.start_step() is not None
        sim.end_step()
    assert sim_batches == real_batches
    assert len({len(b) for b in real_batches}) > 1 and any(n > 1 for b in real_batches for _, _, n in b)
