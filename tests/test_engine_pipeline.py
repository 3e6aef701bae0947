"""Plans with several stages run as real processes (gloo): the same greedy tokens as one process.

Queries join and leave mid-run, prompts are prefilled in chunks, and a small KV cache forces
preemption; the pipelined engine (2 and 3 stages, a mixed bit map) must give token for token
what the same quantized model gives in one process.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from engines.pipeline import StageFailure
from engines.stage_procs import FORK_SERVER_MAX_TENSORS, shared_tensors, stage_context
from localmodels import build_model, default_tokenizer, generated_corpus
from tests import harness

BITS = [8, 4, 16, 8]  # the tiny model's 4 layers


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer(vocab_size=1024, texts=generated_corpus(400))


def write_plan(path, cuts: list[int], bits=BITS, **kw):
    return harness.write_plan(path, "tiny", cuts, bits, vocab=1024, **kw)


PROMPTS = [
    "Write a story about a river and the city beside it, with every detail of the scene",
    "What is 2+2?",
    "Explain the history of music in detail please, with examples from every century and place",
    "hi",
    "Sort a list in python",
    "Give a short summary of the market price of energy this week and the reason for it",
    "Describe the water cycle",
]
LENGTHS = [9, 4, 12, 7, 3, 10, 6]


def _requests() -> list[Request]:
    return [
        Request(f"q{i}", p, SamplingParams(max_tokens=64, forced_length=n), predicted_tokens=1)
        for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True))
    ]


def _engine(tokenizer, plan, **kw) -> LLMEngine:
    model = build_model("llama", "tiny", tokenizer=tokenizer, seed=3)
    cfg = EngineConfig(plan_path=str(plan), prefill_chunk=8, block_size=4, **kw)
    return LLMEngine.build(model, tokenizer, cfg)


def _sampled_requests() -> list[Request]:
    """Odd queries sample (temperature, top-p, a seed each), even ones decode greedily."""
    reqs = _requests()
    for i, r in enumerate(reqs):
        if i % 2:
            r.sampling = SamplingParams(
                temperature=0.9, top_p=0.95, seed=i, max_tokens=64, forced_length=LENGTHS[i]
            )
    return reqs


def _run(engine: LLMEngine, requests: list[Request] | None = None) -> dict[str, list[int]]:
    """Two queries start; one more joins every other step; all run to the end."""
    pending = requests or _requests()
    for r in pending[:2]:
        engine.add_request(r)
    pending = pending[2:]
    out, step = {}, 0
    while engine.has_unfinished() or pending:
        if pending and step % 2 == 1:
            engine.add_request(pending.pop(0))
        for o in engine.step():
            assert o.finish_reason == "length", o
            out[o.request_id] = o.token_ids
        step += 1
    return out


@pytest.fixture(scope="module")
def reference(tokenizer, tmp_path_factory):
    plan = write_plan(tmp_path_factory.mktemp("ref") / "plan.json", [0, 4])
    engine = _engine(tokenizer, plan, kv_budget_tokens=64)
    assert engine.num_stages == 1 and engine.pipeline is None
    return _run(engine)


@pytest.mark.parametrize(
    ("cuts", "head_split"),
    [([0, 2, 4], 0.0), ([0, 1, 3, 4], 0.0), ([0, 2, 4], 0.3), ([0, 1, 3, 4], 0.55), ([0, 2, 4], 1.0)],
    ids=["2-stage", "3-stage", "2-stage-head-split", "3-stage-head-split", "2-stage-whole-head-first"],
)
def test_pipeline_equals_one_process(tokenizer, tmp_path, reference, cuts, head_split):
    plan = write_plan(tmp_path / "plan.json", cuts, head_split=head_split)
    engine = _engine(tokenizer, plan, kv_budget_tokens=64)
    try:
        assert engine.num_stages == len(cuts) - 1
        assert len(engine.pipeline.stage_pids) == len(cuts) - 2
        assert engine.pipeline.head_start == round(head_split * engine.pipeline.vocab)  # rows on the driver
        out = _run(engine)
        assert engine.num_preemptions > 0  # predictions of 1 token and a small cache force preemption
        counters = engine.pipeline.stage_counters()
    finally:
        engine.close()
    assert out == reference
    assert {k: len(v) for k, v in out.items()} == {f"q{i}": n for i, n in enumerate(LENGTHS)}
    # every stage computed micro-batches and reports its memory
    assert all(c["micro_batches"] > 0 and c["compute_s"] > 0 and c["memory_bytes"] > 0 for c in counters)
    assert not any(p.is_alive() for p in engine.pipeline.procs)
    # nothing holds the pipeline once closed, its stage watchdog included: a runner that a daemon thread
    # freed while the interpreter exited aborted the process ("terminate called without an active exception")
    pipeline = weakref.ref(engine.pipeline)
    del engine
    gc.collect()
    assert pipeline() is None


def test_sampled_and_greedy_queries_equal_one_process(tokenizer, tmp_path):
    """Micro-batches whose sampled queries are all greedy get their tokens from the last stage;
    the others bring their logits back to the driver's seeded samplers. Both give the tokens of
    one process."""
    one = _engine(tokenizer, write_plan(tmp_path / "one.json", [0, 4]), kv_budget_tokens=64)
    reference = _run(one, _sampled_requests())
    engine = _engine(
        tokenizer, write_plan(tmp_path / "plan.json", [0, 2, 4], head_split=0.3), kv_budget_tokens=64
    )
    flags, submit = [], engine.pipeline.submit

    def recorded_submit(batch, greedy=False):
        flags.append(greedy)
        submit(batch, greedy)

    engine.pipeline.submit = recorded_submit
    try:
        out = _run(engine, _sampled_requests())
    finally:
        engine.close()
    assert out == reference
    assert True in flags and False in flags  # both replies were exercised


def test_micro_batches_in_flight_are_disjoint_and_fill_the_pipeline(tokenizer, tmp_path):
    engine = _engine(
        tokenizer, write_plan(tmp_path / "plan.json", [0, 2, 4], decode_mb=2), kv_budget_tokens=512
    )
    schedule, submit = engine.scheduler.schedule, engine.pipeline.submit
    seen = {"max_in_flight": 0, "max_decode": 0}

    def checked_schedule(busy):
        out = schedule(busy)
        assert not {c.seq.request_id for c in out.chunks} & set(busy)  # disjoint from those in flight
        seen["max_decode"] = max(seen["max_decode"], sum(c.num_tokens == 1 for c in out.chunks))
        return out

    def counted_submit(batch, greedy=False):
        submit(batch, greedy)
        seen["max_in_flight"] = max(seen["max_in_flight"], engine.pipeline.in_flight)

    engine.scheduler.schedule, engine.pipeline.submit = checked_schedule, counted_submit
    try:
        for r in _requests()[:4]:
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.close()
    assert seen == {"max_in_flight": 2, "max_decode": 2}  # both stages busy; the plan's decode micro-batch


def test_abort_of_a_query_in_flight(tokenizer, tmp_path):
    engine = _engine(tokenizer, write_plan(tmp_path / "plan.json", [0, 2, 4]), kv_budget_tokens=512)
    try:
        reqs = _requests()[:3]
        for r in reqs:
            engine.add_request(r)
        engine.step()
        busy = next(iter(engine._busy))
        engine.abort_request(busy)
        reasons = {}
        while engine.has_unfinished():
            for o in engine.step():
                reasons[o.request_id] = o.finish_reason
        assert reasons[busy] == "abort"
        assert sorted(reasons) == sorted(r.request_id for r in reqs)
        assert engine.kv.used_blocks == 0
    finally:
        engine.close()


def test_memory_cap_names_the_stage(tokenizer, tmp_path):
    plan = write_plan(tmp_path / "plan.json", [0, 2, 4], memory=1 << 20)
    with pytest.raises(ValueError, match=r"stage 0 \(layers \[0, 2\).*caps memory"):
        _engine(tokenizer, plan)


def test_killed_stage_is_named(tokenizer, tmp_path):
    import os
    import signal

    engine = _engine(tokenizer, write_plan(tmp_path / "plan.json", [0, 1, 3, 4]), kv_budget_tokens=512)
    try:
        for r in _requests():
            engine.add_request(r)
        engine.step()
        victim = engine.pipeline.stage_pids[0]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(StageFailure, match=rf"stage 1 \(layers \[1, 3\).*pid {victim}.*signal 9"):
            for _ in range(200):
                engine.step()
    finally:
        engine.close()
    assert not any(p.is_alive() for p in engine.pipeline.procs)
    assert torch.distributed.is_initialized() is False


def test_a_stage_holding_more_tensors_than_the_fork_server_passes_still_starts():
    """Each tensor travels to a stage process as a file descriptor, and the fork server takes at most 256
    per start: a stage of more tensors (a large model's layers) failed to start with 'too many fds'.
    It is spawned."""
    part = nn.ModuleList(nn.Linear(2, 2) for _ in range(150))  # 300 tensors
    assert shared_tensors(part) == 300 > FORK_SERVER_MAX_TENSORS
    p = stage_context(part).Process(target=len, args=(part,))  # the child unpickles every tensor
    p.start()
    p.join(120)
    assert p.exitcode == 0
    small = stage_context(nn.Linear(2, 2))
    assert small.get_start_method() == "forkserver"
