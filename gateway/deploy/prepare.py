"""``fleetbatch gateway prepare``: build once, before any run, what a fresh machine lacks and the runs and tests read.

Every cache the project writes at run time, built here by one explicit command (``scripts/setup.sh``
runs it), so that nothing is built by surprise in the middle of a run or by several test workers at
once:

* the default tokenizer, a byte-level BPE trained on the shared data (or on generated text where
  there is none), in ``$FLEETBATCH_CACHE`` (:func:`localmodels.default_tokenizer`);
* this CPU's profile of the default fleet's served model (``fleetbatch engine profile``), in
  ``$FLEETBATCH_CACHE/profiles`` (:func:`gateway.deploy.fleet_up.cpu_profile`), which ``fleetbatch gateway up``
  plans the default fleet with;
* matplotlib's font cache (``$MPLCONFIGDIR``, else ``~/.cache/matplotlib``), which the plots of the
  studies and reports need;
* the small tokenizers trained on generated text that the test suite's engine tests and the GPU check's
  dry run use (:data:`SMALL_TOKENIZERS`: found in the cache after a test run, built there by four
  workers at once before).

Each is skipped when it is already there (its step builds nothing); a run afterwards only reads them.
The tokenizers and the font cache are built in child processes: this command imports neither torch
nor matplotlib itself.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from gateway.deploy.fleet_up import FleetSettings, cpu_profile
from localmodels.paths import cache_dir

log = logging.getLogger(__name__)

#: (vocabulary, generated texts or None for the default corpus) of the small tokenizers the tests use
SMALL_TOKENIZERS = ((1024, 400), (512, 200), (1024, None))
#: what each child process builds: the default tokenizer, the small ones, matplotlib's font cache
_TOKENIZER = "from localmodels import default_tokenizer; default_tokenizer()"
_SMALL = "from localmodels import default_tokenizer, generated_corpus\n" + "".join(
    f"default_tokenizer(vocab_size={v}{f', texts=generated_corpus({n})' if n else ''})\n"
    for v, n in SMALL_TOKENIZERS
)
_FONTS = "import matplotlib; matplotlib.use('Agg'); import matplotlib.font_manager"


def _child(code: str, what: str, log_file: Path) -> None:
    with open(log_file, "ab") as err:
        done = subprocess.run([sys.executable, "-c", code], stderr=err, check=False)
    if done.returncode != 0:
        tail = " / ".join(log_file.read_text(errors="replace").strip().splitlines()[-3:])
        raise RuntimeError(f"building {what} failed (exit {done.returncode}): {tail} (log: {log_file})")


def _entries() -> set[str]:
    """What the caches hold now: the tokenizers, the profiles, matplotlib's font lists."""
    root = cache_dir()
    found = {p.name for p in root.glob("tokenizer-*")} | {
        f"profiles/{p.name}" for p in root.glob("profiles/*.json")
    }
    mpl = Path(os.environ.get("MPLCONFIGDIR") or Path.home() / ".cache" / "matplotlib")
    return found | {f"matplotlib/{p.name}" for p in mpl.glob("fontlist-*.json")}


def prepare(log_dir: Path) -> dict[str, dict]:
    """Build every cache that is missing: per step, the seconds it took and what it added ([]: all found)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict] = {}
    steps = (
        ("tokenizer", lambda: _child(_TOKENIZER, "the default tokenizer", log_dir / "tokenizer.log")),
        ("cpu_profile", lambda: cpu_profile(FleetSettings(), log_dir)),
        ("matplotlib_fonts", lambda: _child(_FONTS, "matplotlib's font cache", log_dir / "fonts.log")),
        (
            "small_tokenizers",
            lambda: _child(_SMALL, "the tests' small tokenizers", log_dir / "tokenizer.log"),
        ),
    )
    for name, build in steps:
        before, t0 = _entries(), time.perf_counter()
        build()
        added = sorted(_entries() - before)
        out[name] = {"seconds": round(time.perf_counter() - t0, 2), "built": added}
        log.info(
            "%s: %s in %.1f s", name.replace("_", " "), ", ".join(added) or "found", out[name]["seconds"]
        )
    return out


def add_arguments(p) -> None:
    """``fleetbatch gateway prepare``'s options."""
    p.add_argument(
        "--log-dir", default=None, help="logs of the build steps (default: $FLEETBATCH_CACHE/logs)"
    )


def run(args) -> dict:
    """``fleetbatch gateway prepare``: per step the seconds and what it built, the cache's place, the total."""
    steps = prepare(Path(args.log_dir) if args.log_dir else cache_dir() / "logs")
    return {
        "cache": str(cache_dir()),
        "steps": steps,
        "built": sum(len(s["built"]) for s in steps.values()),
        "total_s": round(sum(s["seconds"] for s in steps.values()), 2),
    }
