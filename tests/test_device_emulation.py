"""The cost-model device (``fleetbatch engine serve --device-cost``): what engines report, what the worker charges,
and when a query counts as finished on the emulated device."""

from __future__ import annotations

import time

import pytest

from engines.config import EngineConfig
from engines.device import DeviceClock, StepCost
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from engines.static_engine import StaticBatchEngine, batch_forwards
from engines.worker import Worker, WorkerConfig
from localmodels import build_model, default_tokenizer
from workqueue import QueuedQuery, WorkQueue, connect


def test_parse_reads_milliseconds_and_speed():
    cost = StepCost.parse("8, 0.05, 0.5", speed=0.5)
    assert cost.step_overhead_s == pytest.approx(0.008)
    assert cost.prefill_per_token_s == pytest.approx(0.00005)
    assert cost.decode_per_seq_s == pytest.approx(0.0005)
    # a half-speed device takes twice as long: (8 + 0.05 * 100 + 0.5 * 4) ms / 0.5
    assert cost.step_s(100, 4) == pytest.approx(0.030)
    assert cost.forwards_s([(100, 4, 1), (0, 4, 3)]) == pytest.approx(0.030 + 3 * 0.020)


@pytest.mark.parametrize("text", ["8,0.05", "8,0.05,0.5,1", "a,b,c", "8,-1,0.5", "0,0,0", "inf,0,0"])
def test_parse_refuses_bad_costs(text):
    with pytest.raises(ValueError):
        StepCost.parse(text)


def test_clock_counts_overruns():
    clock = DeviceClock()
    clock.record(device_s=0.010, compute_s=0.004)
    clock.record(device_s=0.010, compute_s=0.013)
    assert (clock.steps, clock.overrun_steps) == (2, 1)
    assert clock.overrun_s == pytest.approx(0.003)
    assert "1 steps (50.0%)" in clock.describe()


def test_native_engine_reports_each_prompt_token_once_and_every_later_token_as_a_decode():
    """Chunked prefill (16 tokens a step) and queries of different lengths: summed over the run, the
    prefill passes cover every prompt token once, and each query decodes forced_length - 1 times (its
    first token comes from the pass that ends its prompt)."""
    config = EngineConfig(max_running=3, max_batch_tokens=16)
    engine = LLMEngine.from_pretrained(None, arch="llama", size="nano", config=config)
    prompts = {"a": list(range(5, 45)), "b": list(range(7, 20)), "c": list(range(3, 30))}
    forced = {"a": 6, "b": 9, "c": 3}
    for rid, ids in prompts.items():
        sampling = SamplingParams(max_tokens=32, forced_length=forced[rid])
        engine.add_request(Request(rid, "", sampling, prompt_token_ids=ids))
    prefill = decode = passes = 0
    while engine.has_unfinished():
        engine.step()
        for p, d, n in engine.stats().step_forwards:
            prefill, decode, passes = prefill + p * n, decode + d * n, passes + n
    assert engine.num_preemptions == 0
    assert prefill == sum(len(ids) for ids in prompts.values())
    assert decode == sum(f - 1 for f in forced.values())
    assert passes == engine.num_steps


def test_static_engine_reports_the_padded_batch():
    tok = default_tokenizer()
    engine = StaticBatchEngine(build_model("llama", "nano", tokenizer=tok), tok, max_batch=4)
    for rid, (n_prompt, forced) in {"a": (12, 5), "b": (30, 2), "c": (7, 9)}.items():
        sampling = SamplingParams(max_tokens=16, forced_length=forced)
        engine.add_request(Request(rid, "", sampling, prompt_token_ids=list(range(3, 3 + n_prompt))))
    outputs = engine.step()
    assert sorted(len(o.token_ids) for o in outputs) == [2, 5, 9]
    # three rows padded to 30 prompt tokens, then all three decode until the longest (9) is done
    assert engine.stats().step_forwards == batch_forwards(3, 30, 9) == ((90, 0, 1), (0, 3, 8))


def test_a_query_finishes_when_the_emulated_device_is_done_with_it(redis_url):
    """The worker stamps a static batch's queries at the end of the modelled step, not when this CPU
    returned from ``generate``: the bug that made static batches look fast by their last batch."""
    queue = WorkQueue(connect(redis_url))
    queries = [
        QueuedQuery("b1", f"q{i}", f"a question about rivers {i}", 64, 8, 20.0, forced_length=20)
        for i in range(3)
    ]
    assert queue.create_batch("b1", [(q, "w") for q in queries])
    tok = default_tokenizer()
    engine = StaticBatchEngine(build_model("llama", "nano", tokenizer=tok), tok, max_batch=4)
    cost = StepCost.parse("100,1,10")  # a slow device: at least 0.1 + 0.3 + 19 x 0.13 s for the batch
    worker = Worker(queue, engine, WorkerConfig(cluster="w", backend="static", device_cost=cost))
    assert worker.run(max_queries=3) == 3
    (p, _, _), (_, rows, decodes) = engine.stats().step_forwards
    modelled = cost.step_s(p, 0) + decodes * cost.step_s(0, rows)
    assert (worker.device.steps, rows, decodes) == (1, 3, 19)
    assert worker.device.device_s == pytest.approx(modelled)
    for r in queue.results("b1"):
        assert r["timings"]["finished_at"] - r["timings"]["started_at"] >= modelled
    assert queue.clusters(["w"])[0].device_steps in (0, 1)  # heartbeats carry the device's counters


@pytest.mark.parametrize("overlap_s", [0.0, 1.0])
def test_the_emulated_device_keeps_its_timeline_over_the_hosts_bookkeeping(redis_url, overlap_s):
    """Issue 33: host work between steps (here 20 ms of bookkeeping, injected) overlaps the device's
    time when the host is back within ``host_overlap_s``: the queries finish when the device's
    back-to-back steps would have; without the overlap every step's gap adds to the finish."""
    queue = WorkQueue(connect(redis_url))
    queries = [
        QueuedQuery("b1", f"q{i}", f"rivers {i}", 64, 8, 6.0, forced_length=4 + 3 * i) for i in range(3)
    ]
    assert queue.create_batch("b1", [(q, "w") for q in queries])
    tok = default_tokenizer()
    engine = LLMEngine(
        build_model("llama", "nano", tokenizer=tok, seed=3),
        tok,
        EngineConfig(kv_budget_tokens=512, block_size=4),
    )
    cost = StepCost.parse("100,1,10")
    config = WorkerConfig(
        cluster="w", backend="native", device_cost=cost, host_overlap_s=overlap_s, record_observed=False
    )
    worker = Worker(queue, engine, config)
    start_claimed = worker.start_claimed

    def slow_bookkeeping() -> None:
        time.sleep(0.02)
        start_claimed()

    worker.start_claimed = slow_bookkeeping  # type: ignore[method-assign]
    assert worker.run(max_queries=3) == 3
    results = queue.results("b1")
    elapsed = max(r["timings"]["finished_at"] for r in results) - min(
        r["timings"]["first_token_at"] for r in results
    )
    steps = worker.device.steps
    assert steps >= 10 and worker.busy_s == pytest.approx(worker.device.device_s)
    # the first token is stamped by this CPU, early in the first step (it did not finish a query)
    if overlap_s:  # the device's steps back to back: at most its modelled seconds
        assert elapsed <= worker.device.device_s + 1e-6
        assert worker.host_overlap_s >= 0.02 * (steps - 1)
    else:  # every gap of at least 20 ms adds (less the first step's compute, well under 0.1 s)
        assert elapsed >= worker.device.device_s + 0.02 * (steps - 1) - 0.1
        assert worker.host_overlap_s == 0.0
