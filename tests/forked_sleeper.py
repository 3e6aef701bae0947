"""A stand-in engine for the fork-server tests: ``main([seconds])`` sleeps, then exits 0."""

from __future__ import annotations

import time


def main(argv: list[str]) -> int:
    time.sleep(float(argv[0]))
    return 0
