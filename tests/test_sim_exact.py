"""The simulator against the real engine: the same admissions, finishes and tokens, step by step.

The real :class:`engines.engine.LLMEngine` (a nano model, forced lengths) is fed as the Redis
worker feeds it -- ``free_slots()`` queries from a queue before every ``step()`` -- and the
scheduler's plans and the KV it reports per step (``kv_step_tokens``) are recorded. The simulator runs the same queries on one cluster, with bulk
decode on and off. A small KV cache makes admission block, queries outgrow their predictions
and get preempted; a roomy cache with a batch of 3 keeps the batch full (20 bulks start from a
full batch there), so the comparison covers the paths where a shortcut could go wrong.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent)
)  # `sim` is not in pyproject's package list yet

from engines.config import EngineConfig  # noqa: E402
from engines.engine import LLMEngine  # noqa: E402
from engines.interface import Request, SamplingParams  # noqa: E402
from load.arrivals import poisson_arrivals  # noqa: E402
from localmodels import build_model, default_tokenizer, generated_corpus  # noqa: E402
from sim.core import ClusterSpec, SimConfig, Simulator  # noqa: E402
from sim.costs import LinearCost  # noqa: E402
from sim.engines import IterationEngine  # noqa: E402
from sim.workload import Workload  # noqa: E402

BLOCK, STEP_TOKENS, CHUNK, MARGIN = 4, 24, 12, 0.1
# (KV tokens, max_running, prefix cache): a tight cache (admission blocks, preemptions: a preempted
# query finds its own blocks cached), the same without the prefix cache, and a roomy one with a small
# batch (the batch fills up: the full-batch bulk path)
CASES = {"tight-kv": (96, 5, True), "tight-kv-no-prefix-cache": (96, 5, False), "full-batch": (1024, 3, True)}


@pytest.fixture(autouse=True)
def audit(monkeypatch):
    monkeypatch.setattr(
        IterationEngine, "AUDIT", True
    )  # every free_slots shortcut checked against the real one


@pytest.fixture(scope="module")
def parts():
    tok = default_tokenizer(vocab_size=1024, texts=generated_corpus(400))
    return build_model("llama", "nano", tokenizer=tok, seed=3), tok


@pytest.fixture(scope="module", params=list(CASES))
def real(request, parts):
    """The real engine's trace per case, run once for both bulk settings (one torch thread: the CPU is shared)."""
    kv, running, cache = CASES[request.param]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return request.param, real_trace(parts, workload(), kv, running, cache)
    finally:
        torch.set_num_threads(threads)


def workload(n: int = 40, seed: int = 2) -> Workload:
    rng = random.Random(seed)
    prompts = [rng.randint(2, 30) for _ in range(n)]
    true = [rng.randint(1, 28) for _ in range(n)]
    pred = [max(0.0, t * rng.choice([0.1, 0.3, 1.0, 1.5])) for t in true]  # some far under: preemptions
    return Workload(prompts, true, pred, [0.0] * n)


def real_trace(parts, w: Workload, kv: int, running: int, cache: bool) -> tuple[list, LLMEngine]:
    model, tok = parts
    cfg = EngineConfig(
        kv_budget_tokens=kv,
        block_size=BLOCK,
        max_batch_tokens=STEP_TOKENS,
        prefill_chunk=CHUNK,
        max_running=running,
        safety_margin=MARGIN,
        prefix_cache=cache,  # unique prompts: hits are a preempted query's own blocks (sim.engines.prefix_keys)
    )
    engine = LLMEngine(model, tok, cfg)
    plans = []
    schedule = engine.scheduler.schedule

    def recording(*a, **kw):
        out = schedule(*a, **kw)
        plans.append(out)
        return out

    engine.scheduler.schedule = recording
    queue = list(range(len(w)))
    trace = []
    while queue or engine.has_unfinished():
        n = min(engine.free_slots(), len(queue))
        for q in queue[:n]:
            sampling = SamplingParams(max_tokens=256, forced_length=w.true_tokens[q])
            ids = [3 + (q + j) % 50 for j in range(w.prompt_tokens[q])]
            engine.add_request(
                Request(
                    str(q),
                    "",
                    sampling,
                    prompt_token_ids=ids,
                    predicted_tokens=int(w.predicted_tokens[q]) or None,
                )
            )
        del queue[:n]
        before = len(plans)
        outs = engine.step()
        assert len(plans) == before + 1
        p = plans[-1]
        kv_step = engine.stats().kv_step_tokens  # KV held while the step ran (what the worker integrates)
        trace.append(
            ([s.request_id for s in p.admitted], [o.request_id for o in outs], p.num_tokens, kv_step)
        )
        assert all(len(o.token_ids) == w.true_tokens[int(o.request_id)] for o in outs)
    return trace, engine


def sim_trace(w: Workload, bulk: bool, kv: int, running: int, cache: bool = True):
    spec = ClusterSpec("c0", LinearCost(), "iteration", batch=running, kv_budget_tokens=kv)
    cfg = SimConfig(
        policy="round_robin",
        offload=False,
        block_size=BLOCK,
        max_batch_tokens=STEP_TOKENS,
        prefill_chunk=CHUNK,
        safety_margin=MARGIN,
        bulk=bulk,
        prefix_cache=cache,
    )
    sim = Simulator([spec], w, cfg)
    engine = sim.clusters[0].engine
    engine.trace = []
    result = sim.run()
    return engine.trace, engine, result


@pytest.mark.parametrize("bulk", [False, True], ids=["step-by-step", "bulk-decode"])
def test_simulator_matches_the_real_engine_step_by_step(real, bulk):
    w = workload()
    case, (real, engine) = real
    kv, running, cache = CASES[case]
    if case.startswith("tight-kv"):
        assert engine.num_preemptions > 0, "the case must exercise preemption"
        assert any(not step[0] for step in real[:20]), "admission must block at some step"
    if cache and case == "tight-kv":
        assert engine.kv.hit_tokens > 0, "a preempted query must find its own blocks cached"
    simulated, sim_engine, result = sim_trace(w, bulk, kv, running, cache)
    assert len(simulated) == len(real)
    for i, (a, b) in enumerate(zip(real, simulated, strict=True)):
        assert a == b, f"step {i}: real {a} != simulated {b}"
    assert sim_engine.num_steps == engine.num_steps
    assert sim_engine.cumulative_kv_tokens == engine.cumulative_kv_tokens
    assert sim_engine.generated_tokens == engine.generated_tokens == sum(w.true_tokens)
    assert result.queries == len(w)
    assert (sim_engine.kv.hit_tokens, sim_engine.kv.lookup_tokens) == (
        engine.kv.hit_tokens,
        engine.kv.lookup_tokens,
    )


@pytest.mark.parametrize("arrivals", ["all-at-once", "poisson"])
def test_bulk_decode_changes_nothing_but_the_work(arrivals):
    """A bigger case without a model: bulk decode and single steps give the same finish times and KV.

    With Poisson arrivals, work reaches engines in the middle of a bulk (~120 bulks are cut short)."""
    rng = random.Random(5)
    n = 300
    w = Workload(
        [rng.randint(5, 200) for _ in range(n)],
        [rng.randint(1, 200) for _ in range(n)],
        [float(rng.randint(1, 200)) for _ in range(n)],
        [0.0] * n,
    )
    if arrivals == "poisson":
        w = w.with_arrivals(poisson_arrivals(n, 3.0, seed=1))
    specs = [ClusterSpec(f"c{i}", LinearCost(speed=s), "iteration", 8, 4096) for i, s in enumerate((1, 2, 4))]
    out = {}
    for bulk in (False, True):
        out[bulk] = Simulator(specs, w, SimConfig(policy="token", bulk=bulk)).run()
    a, b = out[False], out[True]
    assert a.finish_s == pytest.approx(b.finish_s, rel=1e-9, abs=1e-9)
    assert a.cumulative_kv_tokens == b.cumulative_kv_tokens
    assert a.kv_token_seconds == pytest.approx(b.kv_token_seconds, rel=1e-9)
    assert a.kv_cached_token_seconds == pytest.approx(b.kv_cached_token_seconds, rel=1e-9)
    assert a.moved == b.moved
    assert sum(c["steps"] for c in a.per_cluster.values()) == sum(c["steps"] for c in b.per_cluster.values())
