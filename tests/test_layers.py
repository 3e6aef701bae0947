"""The layers between packages hold: `lint-imports` checks the contracts in pyproject.toml
(the layers of docs/layers.md; gateway and engines independent; fleetdata, planfile, cliutil,
workqueue and protos at the bottom; engines and gateway without the planner; load and sim on
top; planner, predictor and quant free of serving code)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    out = subprocess.run([exe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout
