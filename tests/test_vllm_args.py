"""A vLLM a user can configure: ``--vllm-arg KEY=VALUE`` parsed and checked against the pinned vLLM's engine
arguments before vLLM is imported, vLLM's own defaults wherever nothing sets a value, a plan translated into
what vLLM supports with what it cannot honour logged, and the user's arguments over the plan's. vLLM is not
installed here: everything runs on the pure functions."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest

import engines.vllm_backend as vllm_backend
import engines.vllm_engine_args as pinned
from cliutil import enable_config_file
from cliutil.config_file import resolve_config
from engines.vllm_args import (
    FLAG,
    DefaultCount,
    add_vllm_arguments,
    closest_keys,
    given,
    parse_value,
    parse_vllm_arg,
    parse_vllm_args,
)
from engines.vllm_backend import PARTITION_ENV, engine_kwargs, plan_to_vllm, vllm_engine_args
from engines.vllm_engine import VLLMEngine
from fleetbatch.vocabulary import VOCABULARY
from tests.test_vllm_backend import make_plan

REPO = Path(__file__).resolve().parent.parent


def _serve_args(**kw) -> argparse.Namespace:
    base = dict(
        served_model="/models/m", plan=None, max_running=DefaultCount(8), prefix_cache=True, vllm_arg=None
    )
    return argparse.Namespace(**{**base, **kw})


def test_the_list_is_the_pinned_vllms_engine_args_and_the_extra_pins_it():
    names = pinned.ENGINE_ARGS
    assert len(names) > 100 and all(re.fullmatch(r"_?[a-z][a-z0-9_]*", n) for n in names)
    # every argument the translation and the flags set is one of them
    t = plan_to_vllm(make_plan([4, 4], [16] * 8), "/m", gpu_memory_utilization=0.8, max_model_len=2048)
    assert set(t.engine_args) | {"enable_prefix_caching", "max_num_seqs"} <= names
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert extra == [pinned.VLLM_REQUIREMENT]
    low, high = re.fullmatch(r"vllm>=([\d.]+),<([\d.]+)", pinned.VLLM_REQUIREMENT).groups()

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("."))

    assert pinned.VLLM_VERSIONS[0] == low and all(
        key(low) <= key(v) < key(high) for v in pinned.VLLM_VERSIONS
    )
    doc = pinned.__doc__ or ""
    assert "vllm/engine/arg_utils.py" in doc and all(v in doc for v in pinned.VLLM_VERSIONS)


def test_keys_take_dashes_or_underscores_and_values_parse_as_json_else_strings():
    assert parse_vllm_arg("max-model-len=8192") == ("max_model_len", 8192)
    assert parse_vllm_arg("--gpu-memory-utilization=0.85") == ("gpu_memory_utilization", 0.85)
    assert parse_vllm_arg(" enforce_eager = true") == ("enforce_eager", True)
    assert parse_vllm_arg("dtype=bfloat16") == ("dtype", "bfloat16")
    assert parse_vllm_arg("hf_token=ab=cd") == ("hf_token", "ab=cd")  # the first = splits
    assert parse_value("[1, 2]") == [1, 2] and parse_value("null") is None and parse_value('"1"') == "1"
    assert parse_value('{"level": 3}') == {"level": 3} and parse_value("") == ""
    assert parse_vllm_args(["max_num_seqs=4", "dtype=half", "max-num-seqs=16"]) == {
        "dtype": "half",
        "max_num_seqs": 16,
    }  # the last of a key given twice counts
    assert parse_vllm_args(None) == {}


def test_a_misspelt_key_is_refused_naming_it_and_the_closest_keys():
    with pytest.raises(
        ValueError, match=r"--vllm-arg max-num-seq: not an engine argument of vLLM 0\.11"
    ) as e:
        parse_vllm_arg("max-num-seq=8")
    assert "did you mean max_num_seqs" in str(e.value)
    assert closest_keys("gpu_memory_utilisation")[0] == "gpu_memory_utilization"
    with pytest.raises(ValueError, match="none is close"):
        parse_vllm_arg("zzzz=1")
    for bad in ("max_model_len", "=3", "  =3"):
        with pytest.raises(ValueError, match="expected KEY=VALUE"):
            parse_vllm_arg(bad)


def test_a_bad_key_is_refused_before_vllm_is_imported():
    assert "vllm" not in sys.modules
    with pytest.raises(ValueError, match="did you mean max_model_len"):
        VLLMEngine.from_args(_serve_args(vllm_arg=["max_modl_len=4096"]))  # vLLM is not even installed here
    assert "vllm" not in sys.modules


def test_without_a_plan_vllms_defaults_hold_and_max_running_counts_only_when_given():
    assert engine_kwargs(_serve_args()) == {"model": "/models/m", "enable_prefix_caching": True}
    assert engine_kwargs(_serve_args(max_running=8))["max_num_seqs"] == 8  # given, even at the default
    assert given(DefaultCount(8)) is None and given(3) == 3 and given(None) is None
    kw = engine_kwargs(
        _serve_args(vllm_arg=["dtype=bfloat16", "gpu_memory_utilization=0.7"], prefix_cache=False)
    )
    assert kw == {
        "model": "/models/m",
        "enable_prefix_caching": False,
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.7,
    }
    assert engine_kwargs(_serve_args(served_model=None, vllm_arg=["model=/x"]))["model"] == "/x"
    with pytest.raises(ValueError, match="--served-model"):
        engine_kwargs(_serve_args(served_model=None))


def test_a_plan_sets_only_what_it_knows_and_max_model_len_reaches_vllm(monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    plans = {"plan.json": make_plan([10, 14, 8], [16] * 32)}
    monkeypatch.setattr(vllm_backend, "load_plan", plans.__getitem__)
    kw = engine_kwargs(_serve_args(plan="plan.json", vllm_arg=["max-model-len=4096"]))
    assert kw["max_model_len"] == 4096 and kw["max_num_seqs"] == 32 and kw["pipeline_parallel_size"] == 3
    assert not {"dtype", "gpu_memory_utilization", "seed", "quantization"} & set(kw)
    assert os.environ[PARTITION_ENV] == "10,14,8"


def test_the_users_arguments_override_the_plans_and_a_log_line_says_which(caplog):
    caplog.set_level(logging.INFO, logger="engines.vllm_backend")
    t = vllm_engine_args(
        "/m", make_plan([8], [16] * 8), max_running=5, vllm_args=["max_num_seqs=64", "enforce_eager=true"]
    )
    assert t.engine_args["max_num_seqs"] == 64 and t.engine_args["enforce_eager"] is True
    said = caplog.text
    assert f"{FLAG} max_num_seqs=64 overrides 32 from the plan" in said
    assert f"{FLAG} sets enforce_eager=true" in said
    assert "--max-running 5 is not used" in said


def test_what_vllm_cannot_honour_is_logged_as_a_warning(caplog):
    caplog.set_level(logging.WARNING, logger="engines.vllm_backend")
    plan = make_plan([10, 14, 8], [16] * 16 + [8] * 16)
    plan.devices[1]["type"] = "T4"
    t = vllm_engine_args("/m", plan, vllm_args=["pipeline_parallel_size=2", "kv-cache-dtype=fp8"])
    assert t.env == {} and t.engine_args["pipeline_parallel_size"] == 2
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("stage split 10,14,8 is ignored" in w for w in warned)
    assert any("mixed bit map [8, 16]" in w for w in warned)
    assert any("KV bits are ignored" in w for w in warned)
    assert any("V100-32G, T4, V100-32G" in w and "CUDA_VISIBLE_DEVICES" in w for w in warned)
    assert len(warned) == len(t.notes) == 4


def test_the_flag_comes_from_the_config_file_and_the_environment(tmp_path):
    p = argparse.ArgumentParser()
    p.add_argument("--max-running", type=int, default=DefaultCount(8))
    add_vllm_arguments(p)
    enable_config_file(p)
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("vllm_arg: [max_model_len=4096, 'dtype=bfloat16']\nmax_running: 8\n")
    a = resolve_config(p.parse_args(["--config-file", str(cfg)]), environ={})
    assert a.vllm_arg == ["max_model_len=4096", "dtype=bfloat16"] and given(a.max_running) == 8
    a = resolve_config(p.parse_args([]), environ={"FLEETBATCH_VLLM_ARG": "enforce_eager=true seed=1"})
    assert parse_vllm_args(a.vllm_arg) == {"enforce_eager": True, "seed": 1} and given(a.max_running) is None
    a = resolve_config(p.parse_args([FLAG, "seed=2", FLAG, "seed=3", "--config-file", str(cfg)]), environ={})
    assert a.vllm_arg == ["seed=2", "seed=3"]  # flags replace the file's list


def test_the_vocabulary_gives_the_flag_its_own_meaning():
    p = argparse.ArgumentParser()
    add_vllm_arguments(p)
    assert any(FLAG in a.option_strings for a in p._actions)
    meaning = VOCABULARY[FLAG]
    assert "vLLM" in meaning and "KEY=VALUE" in meaning and meaning != VOCABULARY["--engine-arg"]
