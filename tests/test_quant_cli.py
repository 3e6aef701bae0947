"""The ``quant`` CLI: JSON last line, clear errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quant.cli import main
from quant.indicator import load_indicator


def test_bytes_opt13b(capsys):
    assert main(["bytes", "--shape", "opt-13b"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["layers"] == 40
    assert int(out["layer_bytes"]["4"]) < int(out["layer_bytes"]["8"]) < int(out["layer_bytes"]["16"])
    assert out["kv_bytes_per_token_per_layer"]["16"] == 2 * 5120 * 2


def test_synthetic_indicator_file(tmp_path, capsys):
    path = tmp_path / "om.json"
    assert main(["synthetic-indicator", "--shape", "opt-30b", "--out", str(path), "--bits", "3,4,8,16"]) == 0
    omega, meta = load_indicator(path)
    assert len(omega) == 48 and meta["source"] == "synthetic" and meta["model"] == "opt-30b"


def test_bad_input_is_a_message_not_a_traceback(tmp_path, capsys):
    # one real subprocess (the console entry point as users run it) ...
    r = subprocess.run(
        [sys.executable, "-m", "quant.cli", "eval", "--served-model", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0
    assert "no config.json" in r.stderr and "Traceback" not in r.stderr
    # ... and the same error path in-process for the other cases
    assert main(["bytes", "--shape", "gpt-9"]) == 1
    assert "unknown model" in capsys.readouterr().err
    assert main(["train-tiny", "--hidden", "100"]) == 1
    assert "multiple of 64" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["synthetic-indicator", "--shape", "opt-13b", "--bits", "5"])
    assert e.value.code == 2 and "bit widths" in capsys.readouterr().err
