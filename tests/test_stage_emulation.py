"""``fleetbatch engine serve --plan P --device-cost plan``: every stage emulates its plan device by the device's
cost model (real stage processes, the random nano model).

Each stage's modelled seconds must be what :meth:`planfile.DeviceCost.micro_batch_s` charges for
the micro-batches it computed (its layers at their bits, the prompt chunks and decode contexts of
each micro-batch, its share of the LM head); a model far faster than the CPU makes every
micro-batch an overrun, one far slower none; the worker's totals (its heartbeat) sum the stages;
and ``fleetbatch engine serve`` refuses the combinations of flags that cannot work, with exit code 1.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engines.cli import main
from engines.config import EngineConfig, PipelineConfig
from engines.emulation import EmulatedDevice, batch_shape
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from engines.metrics import StageCollector
from engines.step_batch import ChunkLayout, StepBatch
from engines.worker import Worker, WorkerConfig
from localmodels import build_model, default_tokenizer
from planfile import DeviceCost
from tests import harness
from workqueue import QueuedQuery, WorkQueue, connect

BITS = [8, 16]  # the nano model's 2 layers
LAYER_S = 0.02  # seconds per layer per phase of a micro-batch on the test devices


def cost(layer_s: float, head: list[float] | None = None) -> dict:
    """A device that takes ``layer_s`` per layer for a micro-batch's prefills and as much for its decodes."""
    return {
        "prefill": {str(b): [layer_s, 0, 0, 0, 0] for b in (4, 8, 16)},
        "decode": {str(b): [layer_s, 0, 0, 0] for b in (4, 8, 16)},
        "head": head,
    }


def write_plan(path, cuts: list[int], costs: list[dict | None], head_split: float = 0.0):
    harness.write_plan(path, "nano", cuts, BITS, vocab=1024, head_split=head_split)
    plan = json.loads(path.read_text())
    for dev, c in zip(plan["devices"], costs, strict=True):
        dev["cost"] = c
    path.write_text(json.dumps(plan))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer(vocab_size=1024)


def engine_for(tokenizer, plan, **pipeline) -> LLMEngine:
    model = build_model("llama", "nano", tokenizer=tokenizer, seed=5)
    config = EngineConfig(
        plan_path=str(plan),
        prefill_chunk=8,
        block_size=4,
        kv_budget_tokens=256,
        pipeline=PipelineConfig(emulate_cost=True, **pipeline),
    )
    return LLMEngine.build(model, tokenizer, config)


def requests() -> list[Request]:
    prompts = [list(range(5, 17)), list(range(7, 12)), list(range(3, 9))]  # 12 tokens: two chunks of 8
    return [
        Request(
            f"q{i}",
            "",
            SamplingParams(temperature=t, seed=i, max_tokens=8, forced_length=3),
            prompt_token_ids=ids,
        )
        for i, (ids, t) in enumerate(zip(prompts, [0.0, 0.8, 0.0], strict=True))
    ]


def run_recorded(engine: LLMEngine, reqs: list[Request]) -> list[StepBatch]:
    """Run ``reqs`` to the end; returns the micro-batches submitted to the pipeline."""
    batches, submit = [], engine.pipeline.submit

    def recorded(batch, greedy=False):
        batches.append(batch)
        submit(batch, greedy)

    engine.pipeline.submit = recorded
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    return batches


def charged(c: dict, layer_bits: list[int], batch: StepBatch, head_rows: float) -> float:
    """What the plan's cost charges a micro-batch, its shape read here from the layout itself."""
    prefill = [ch.num_tokens for ch in batch.chunks if not (ch.num_tokens == 1 and ch.start > 0)]
    decode = [ch.start + 1 for ch in batch.chunks if ch.num_tokens == 1 and ch.start > 0]
    return DeviceCost.from_dict(c).micro_batch_s(layer_bits, prefill, decode, head_rows)


def test_a_batch_shape_is_its_prompt_chunks_and_decode_contexts():
    batch = StepBatch(
        [
            ChunkLayout(0, 5, True, (0, 1)),
            ChunkLayout(8, 4, False, (2, 3, 4)),
            ChunkLayout(6, 1, True, (5, 6)),
        ],
        block_size=4,
    )
    assert batch_shape(batch) == ([5, 4], [7])
    device = EmulatedDevice.for_stage(DeviceCost.from_dict(cost(0.5, [1.0, 0.25])), (8, 16), 2, 0.5, "s")
    # 2 layers x (prefill 0.5 + decode 0.5) + head over 2 sampled rows x 0.5: 1 + 0.25 x 1
    assert device.micro_batch_s(batch) == pytest.approx(2.0 + 1.25)
    assert device.layers_s(batch) + device.head_s(batch) == pytest.approx(device.micro_batch_s(batch))


@pytest.mark.parametrize(
    ("why", "kw"),
    [
        ("has no 'cost'", {"cost": None}),
        ("bits for 1 of its 2 layers", {"layer_bits": (8,)}),
        (r"no coefficients for \[2\] bits", {"layer_bits": (2, 8)}),
    ],
)
def test_a_device_that_cannot_be_emulated_is_named(why, kw):
    args = {"cost": DeviceCost.from_dict(cost(0.1)), "layer_bits": (8, 16)} | kw
    with pytest.raises(ValueError, match=rf"stage 1: .*{why}"):
        EmulatedDevice.for_stage(args["cost"], args["layer_bits"], 2, 0.0, "stage 1")


def test_each_stage_is_charged_its_device_cost(tokenizer, tmp_path):
    """Two stages of unlike devices, a head split: stage 0 is charged its layer and its share of the
    head, stage 1 its layer and the rest of the head, for every micro-batch (prompt chunks, decodes
    and both at once). The charge is the model's whatever the compute took."""
    head = [0.002, 0.001]
    costs = [cost(LAYER_S, head), cost(2 * LAYER_S, head)]
    plan = write_plan(tmp_path / "plan.json", [0, 1, 2], costs, head_split=0.4)
    engine = engine_for(tokenizer, plan)
    try:
        batches = run_recorded(engine, requests())
        rows = engine.pipeline.stage_counters()
        share = engine.pipeline.head_start / engine.pipeline.vocab
        stats = engine.stats()
        registry = CollectorRegistry()
        registry.register(StageCollector(engine))
        metrics = generate_latest(registry).decode()
    finally:
        engine.close()
    assert 0 < share < 1
    shapes = [batch_shape(b) for b in batches]
    assert any(p and d for p, d in shapes) and any(not p for p, _ in shapes)  # mixed and decode-only
    assert [r["device_steps"] for r in rows] == [len(batches)] * 2
    for k, (c, bits, rows_share) in enumerate([(costs[0], [8], share), (costs[1], [16], 1 - share)]):
        expected = sum(charged(c, bits, b, len(b.sample_rows) * rows_share) for b in batches)
        assert rows[k]["device_s"] == pytest.approx(expected)
    # with these coefficients: a layer's charge per phase present in the micro-batch, plus the head
    phases = sum(bool(p) + bool(d) for p, d in shapes)
    heads = sum(head[0] + head[1] * len(b.sample_rows) * (1 - share) for b in batches if b.sample_rows)
    assert rows[1]["device_s"] == pytest.approx(phases * 2 * LAYER_S + heads)
    assert stats.device_steps == 2 * len(batches)
    for k, r in enumerate(rows):  # beside the other per-stage figures
        for name, key in [
            ("device_seconds", "device_s"),
            ("device_overrun_micro_batches", "device_overrun_steps"),
        ]:
            prefix = f"fleetbatch_stage_{name}_total{{"
            line = next(x for x in metrics.splitlines() if x.startswith(prefix) and f'stage="{k}"' in x)
            assert float(line.split()[-1]) == pytest.approx(r[key])
    assert stats.device_overrun_steps == sum(int(r["device_overrun_steps"]) for r in rows)


def test_a_device_far_slower_than_the_cpu_never_overruns(tokenizer, tmp_path):
    """A second per layer and phase (a nano layer computes in well under 0.3 s even on a busy CPU):
    every micro-batch sleeps, none overruns."""
    plan = write_plan(tmp_path / "plan.json", [0, 1, 2], [cost(1.0), cost(1.0)])
    engine = engine_for(tokenizer, plan)
    try:
        one = Request("q", "", SamplingParams(max_tokens=8, forced_length=2), prompt_token_ids=[5, 6, 7])
        batches = run_recorded(engine, [one])  # its prompt, then one decode
        rows = engine.pipeline.stage_counters()
    finally:
        engine.close()
    assert len(batches) == 2
    for r in rows:
        assert (r["device_steps"], r["device_s"]) == (2, pytest.approx(2.0))
        assert (r["device_overrun_steps"], r["device_overrun_s"]) == (0, 0)
        assert r["sleep_s"] > 0


def test_a_device_far_faster_than_the_cpu_overruns_every_micro_batch(tokenizer, tmp_path):
    plan = write_plan(tmp_path / "plan.json", [0, 1, 2], [cost(0.0), cost(0.0)])
    engine = engine_for(tokenizer, plan)
    try:
        batches = run_recorded(engine, requests())
        rows = engine.pipeline.stage_counters()
    finally:
        engine.close()
    for r in rows:
        assert r["device_steps"] == r["device_overrun_steps"] == len(batches)
        assert r["device_s"] == 0 and r["device_overrun_s"] > 0 and r["sleep_s"] == 0


def test_a_one_stage_plan_is_emulated_in_process(tokenizer, tmp_path):
    plan = write_plan(tmp_path / "plan.json", [0, 2], [cost(LAYER_S)])
    engine = engine_for(tokenizer, plan)
    assert engine.pipeline is None and engine.emulated is not None
    charges = []
    run = engine.runner.run_batch

    def recorded(batch):
        charges.append(charged(cost(LAYER_S), BITS, batch, len(batch.sample_rows)))
        return run(batch)

    engine.runner.run_batch = recorded
    for r in requests():
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    clock = engine.device_clock
    assert clock.steps == len(charges) and clock.device_s == pytest.approx(sum(charges))
    stats = engine.stats()
    assert (stats.device_steps, stats.device_overrun_steps) == (clock.steps, clock.overrun_steps)


def test_the_worker_sums_the_stages_and_stamps_queries_after_their_device(tokenizer, tmp_path, redis_url):
    """Through the Redis worker: its totals (what its heartbeat carries) are every stage's micro-batches,
    and a query finishes no earlier than its micro-batches took on both devices (each of its
    forced 3 tokens needs a micro-batch through both stages, one after the other)."""
    queue = WorkQueue(connect(redis_url))
    queries = [
        QueuedQuery("b1", f"q{i}", f"rivers and hills {i}", 8, 3, 3.0, forced_length=3) for i in range(3)
    ]
    assert queue.create_batch("b1", [(q, "w") for q in queries])
    plan = write_plan(tmp_path / "plan.json", [0, 1, 2], [cost(LAYER_S), cost(0.0)])
    engine = engine_for(tokenizer, plan)
    worker = Worker(queue, engine, WorkerConfig(cluster="w", backend="native"))
    try:
        assert worker.run(max_queries=3) == 3
        rows = engine.pipeline.stage_counters()
    finally:
        engine.close()
    steps = sum(int(r["device_steps"]) for r in rows)
    overruns = sum(int(r["device_overrun_steps"]) for r in rows)
    assert rows[1]["device_overrun_steps"] == rows[1]["device_steps"] > 0  # the 0-cost device
    assert worker.device_totals() == (steps, overruns)
    assert worker.device.steps == 0  # the worker itself emulates nothing
    for r in queue.results("b1"):
        assert r["timings"]["finished_at"] - r["timings"]["started_at"] >= 3 * LAYER_S


def serve(*flags: str) -> list[str]:
    return ["serve", "--cluster", "c", "--redis-url", "redis://127.0.0.1:1", *flags]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device-cost", "plan"], "pass --plan"),
        (["--device-cost", "plan", "--plan", "{plan}", "--slowdown", "1"], "--slowdown are two ways"),
        (["--device-cost", "8,0.05,0.5", "--plan", "{plan}"], "pass '--device-cost plan'"),
        (["--device-cost", "plan", "--plan", "{bare}"], r"stage 1 \(layers \[1, 2\).*has no 'cost'"),
        (["--device-cost", "plan", "--plan", "{plan}", "--backend", "static"], "not the static backend"),
        (["--device-cost", "plan", "--plan", "{plan}", "--device-speed", "2"], "carry their own"),
        (["--device-cost", "plan", "--plan", "{missing}"], "not found"),
    ],
    ids=["no-plan", "slowdown", "numeric-with-plan", "device-without-cost", "static", "speed", "no-file"],
)
def test_serve_refuses_what_cannot_be_emulated(tmp_path, caplog, flags, message):
    paths = {
        "plan": write_plan(tmp_path / "plan.json", [0, 1, 2], [cost(0.1), cost(0.1)]),
        "bare": write_plan(tmp_path / "bare.json", [0, 1, 2], [cost(0.1), None]),
        "missing": tmp_path / "missing.json",
    }
    with caplog.at_level(logging.ERROR):
        assert main(serve(*(f.format(**paths) for f in flags))) == 1
    assert "--device-cost" in caplog.text
    assert any(re.search(message, r.getMessage()) for r in caplog.records), caplog.text
