"""The ``engine`` CLI: ``generate`` JSONL in/out, clear errors on bad input, ``bench`` last-line JSON."""

from __future__ import annotations

import json

from engines.cli import main


def test_generate_jsonl_roundtrip(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"id": "a", "prompt": "Write a story", "max_tokens": 5})
        + "\n\n"
        + json.dumps({"id": "b", "prompt": "hi", "forced_length": 3, "temperature": 0.7, "seed": 1})
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    assert main(["generate", str(src), "-o", str(out), "--size", "nano", "--token-ids"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"]
    assert (
        rows[1]["completion_tokens"] == 3 == len(rows[1]["token_ids"])
        and rows[1]["finish_reason"] == "length"
    )
    assert 1 <= rows[0]["completion_tokens"] <= 5
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["requests"] == 2 and summary["errors"] == 0


def test_generate_bad_input_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    assert main(["generate", str(bad), "--size", "nano"]) == 1
    assert "line 1 needs a string 'prompt'" in capsys.readouterr().err
    bad.write_text("{not json\n")
    assert main(["generate", str(bad), "--size", "nano"]) == 1
    assert "line 1 is not valid JSON" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "missing.jsonl"), "--size", "nano"]) == 1
    assert "not found" in capsys.readouterr().err


def test_bench_prints_one_json_object_last(data_root, tmp_path, capsys):
    argv = [
        "bench", "--data-dir", str(data_root), "--size", "nano", "--num-queries", "6", "--batch-size", "3",
        "--max-len", "6", "--max-prompt", "16", "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("tokens_per_s", "speedup_vs_static", "speedup_vs_hf_continuous", "kv_ratio_vs_static"):
        assert last[key] > 0, key
    m = last["methods"]
    assert (
        m["static"]["tokens"]
        == m["engine"]["tokens"]
        == m["hf_continuous"]["tokens"]
        == last["forced_tokens"]
    )
    assert m["engine"]["cumulative_kv_tokens"] <= m["static"]["cumulative_kv_tokens"]
    assert all((tmp_path / p.split("/")[-1]).exists() for p in last["figures"])


def test_bench_rejects_unknown_method(capsys):
    assert main(["bench", "--methods", "static,magic"]) == 1
    assert "unknown method" in capsys.readouterr().err


def test_prefix_bench_prints_the_cache_figures_last(data_root, capsys):
    argv = [
        "bench", "--prefix-workload", "--data-dir", str(data_root), "--size", "nano", "--num-queries", "10",
        "--prefix-groups", "2", "--max-len", "4", "--repeats", "1",
    ]  # fmt: skip
    assert main(argv) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["prefix_speedup"] > 0 and last["unique_slowdown"] < 1
    assert 0 < last["hit_rate"] < 1
    shared = last["runs"]["shared_prefix"]
    assert shared["cache_off"]["tokens"] == shared["cache_on"]["tokens"] > 0
    assert shared["cache_off"]["prefill_tokens_saved"] == 0 < shared["cache_on"]["prefill_tokens_saved"]
    assert set(last["unique_tokens_per_s"]) == {"cache_off", "cache_on"}


def test_prefix_bench_rejects_a_bad_share(capsys):
    assert main(["bench", "--prefix-workload", "--unique-share", "1.5"]) == 1
    assert "--unique-share" in capsys.readouterr().err
