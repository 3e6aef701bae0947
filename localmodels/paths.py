"""Where local models, tokenizers and profiles are cached (``$FLEETBATCH_CACHE``, else
``~/.cache/fleetbatch``): a light module, so that a command that only needs the path does not
import torch and transformers."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FLEETBATCH_CACHE"


def cache_dir() -> Path:
    p = Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "fleetbatch"))
    p.mkdir(parents=True, exist_ok=True)
    return p
