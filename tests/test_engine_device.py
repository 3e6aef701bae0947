"""The model runner runs on the device it is given: the CPU by default, CUDA only when it is there.

Asked for CUDA on a machine without it, the engine and ``fleetbatch engine serve --device cuda`` fail with a
clear error instead of running on the CPU.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from engines.cli import main
from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from engines.model_runner import resolve_device
from localmodels import build_model, default_tokenizer, generated_corpus


@pytest.fixture(scope="module")
def engine_parts():
    tok = default_tokenizer(vocab_size=1024, texts=generated_corpus(400))
    return build_model("llama", "nano", tokenizer=tok, seed=3), tok


def greedy_tokens(parts, device: str) -> tuple[LLMEngine, dict[str, list[int]]]:
    model, tok = parts
    engine = LLMEngine(
        copy.deepcopy(model), tok, EngineConfig(kv_budget_tokens=512, block_size=4, device=device)
    )
    outs = engine.generate(
        [Request(f"r{i}", p, SamplingParams(max_tokens=6)) for i, p in enumerate(["Write a story", "hi"])]
    )
    return engine, {o.request_id: o.token_ids for o in outs}


def no_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_the_runner_computes_on_the_cpu_by_default(engine_parts):
    assert EngineConfig().device == "cpu" and resolve_device("cpu") == torch.device("cpu")
    engine, tokens = greedy_tokens(engine_parts, "cpu")
    runner = engine.runner
    assert runner.device.type == "cpu"
    assert next(runner.model.parameters()).device.type == "cpu"
    assert all(t.device.type == "cpu" for t in runner.k_cache.values())
    assert all(len(ids) == 6 for ids in tokens.values())


def test_cuda_without_cuda_is_an_error_not_a_cpu_run(engine_parts, monkeypatch):
    no_cuda(monkeypatch)
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        greedy_tokens(engine_parts, "cuda:0")


@pytest.mark.parametrize("name", ["tpu", "mps", "cuda0", ""])
def test_unknown_devices_are_refused(name):
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device=name).validate()


def test_serve_with_an_unavailable_device_exits_with_a_message(monkeypatch, caplog):
    no_cuda(monkeypatch)
    argv = ["serve", "--cluster", "c", "--redis-url", "redis://127.0.0.1:1", "--device", "cuda"]
    with caplog.at_level(logging.ERROR):
        assert main(argv) == 1
    assert "CUDA is not available" in caplog.text
    argv = ["serve", "--cluster", "c", "--redis-url", "redis://127.0.0.1:1", "--device", "tpu"]
    assert main(argv) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_runs_on_the_gpu(engine_parts):
    engine, tokens = greedy_tokens(engine_parts, "cuda")
    assert engine.runner.device.type == "cuda"
    assert next(engine.runner.model.parameters()).device.type == "cuda"
    assert all(t.device.type == "cuda" for t in engine.runner.k_cache.values())
    assert all(len(ids) == 6 for ids in tokens.values())
