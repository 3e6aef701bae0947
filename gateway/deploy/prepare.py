"""``gateway prepare``: build once, before any run, what a fresh machine lacks and the main job and tests need.

Every cache the project writes at run time, built here by one explicit command (``scripts/setup.sh``
runs it), so that nothing is built by surprise in the middle of a run or by several test workers at
once:

* the default tokenizer, a byte-level BPE trained on the shared data (or on generated text where
  there is none), in ``$FLEETBATCH_CACHE`` (:func:`localmodels.default_tokenizer`);
* this CPU's profile of the default fleet's served model (``engine profile``), in
  ``$FLEETBATCH_CACHE/profiles`` (:func:`gateway.deploy.fleet_up.cpu_profile`), which ``gateway up``
  plans the default fleet with;
* matplotlib's font cache (``$MPLCONFIGDIR``, else ``~/.cache/matplotlib``), which the plots of the
  studies and reports need.

Each is skipped when it is already there; a run afterwards only reads them. The tokenizer and the
font cache are built in child processes: this command imports neither torch nor matplotlib itself.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

from gateway.deploy.fleet_up import FleetSettings, cpu_profile
from localmodels.paths import cache_dir

log = logging.getLogger(__name__)

#: what each child process builds: the default tokenizer, matplotlib's font cache
_TOKENIZER = "from localmodels import default_tokenizer; default_tokenizer()"
_FONTS = "import matplotlib; matplotlib.use('Agg'); import matplotlib.font_manager"


def _child(code: str, what: str, log_file: Path) -> None:
    with open(log_file, "ab") as err:
        done = subprocess.run([sys.executable, "-c", code], stderr=err, check=False)
    if done.returncode != 0:
        tail = " / ".join(log_file.read_text(errors="replace").strip().splitlines()[-3:])
        raise RuntimeError(f"building {what} failed (exit {done.returncode}): {tail} (log: {log_file})")


def prepare(log_dir: Path) -> dict[str, float]:
    """Build every cache that is missing; seconds spent on each (0 when it was there already)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    steps = (
        ("tokenizer", lambda: _child(_TOKENIZER, "the default tokenizer", log_dir / "tokenizer.log")),
        ("cpu_profile", lambda: cpu_profile(FleetSettings(), log_dir)),
        ("matplotlib_fonts", lambda: _child(_FONTS, "matplotlib's font cache", log_dir / "fonts.log")),
    )
    for name, build in steps:
        t0 = time.perf_counter()
        build()
        seconds[name] = round(time.perf_counter() - t0, 2)
        log.info("%s ready in %.1f s", name.replace("_", " "), seconds[name])
    return seconds


def run(args) -> dict:
    """``gateway prepare``: the caches built, their place and the seconds each took."""
    seconds = prepare(Path(args.log_dir) if args.log_dir else cache_dir() / "logs")
    return {"cache": str(cache_dir()), "seconds": seconds, "total_s": round(sum(seconds.values()), 2)}
