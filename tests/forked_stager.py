"""A stand-in engine for the fork-server tests: ``main([path])`` starts one process as a pipeline starts its
stages (the ``forkserver`` context) and writes that process's parent pid to ``path``."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path


def _report(path: str) -> None:
    Path(path).write_text(f"{os.getppid()} {os.getpid()}")


def main(argv: list[str]) -> int:
    ctx = mp.get_context("forkserver")
    p = ctx.Process(target=_report, args=(argv[0],))
    p.start()
    p.join(30)
    return p.exitcode if p.exitcode is not None else 1
