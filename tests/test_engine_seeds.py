"""A query without a seed samples the same tokens in every process (a retried or moved query too)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.harness import REPO

DRAW = """
import torch
from engines.interface import Request, SamplingParams
from engines.sequence import Sequence
seq = Sequence.from_request(Request("b:q7", "p", SamplingParams(max_tokens=4, temperature=0.8)), [1, 2])
print(torch.rand(4, generator=seq.generator).tolist())
"""


def draw(hash_seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run(
        [sys.executable, "-c", DRAW], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_unseeded_sampling_does_not_depend_on_the_process():
    assert draw("1") == draw("2")
