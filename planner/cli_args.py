"""Option parsing shared by the ``planner`` subcommands: the error type and comma-separated integer sets."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class CliError(Exception):
    """Bad input: reported as one line, exit status 1."""


@contextmanager
def bad_input(*types: type[Exception]) -> Iterator[None]:
    """Report ``types`` (default ``ValueError``) raised inside as a :class:`CliError` with the same message."""
    caught = types or (ValueError,)
    try:
        yield
    except caught as e:
        raise CliError(str(e)) from None


def _int_set(text: str, what: str, example: str) -> tuple[int, ...]:
    """Sorted distinct integers of a comma-separated option value (``what``/``example`` name it in errors)."""
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be integers like {example}, got {text!r}") from None


def _bits(text: str) -> tuple[int, ...]:
    bits = _int_set(text, "bit widths", "3,4,8,16")
    if not bits or any(b not in (2, 3, 4, 8, 16) for b in bits):
        raise argparse.ArgumentTypeError(f"bit widths must be among 2,3,4,8,16, got {text!r}")
    return bits


def _chunks(text: str) -> tuple[int, ...]:
    ks = _int_set(text, "prefill chunks", "1,2,4")
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"prefill chunks must be >= 1, got {text!r}")
    return ks


def _tp_sizes(text: str) -> tuple[int, ...]:
    vals = _int_set(text, "tensor-parallel sizes", "1,2,4")
    if not vals or any(v not in (1, 2, 4) for v in vals):
        raise argparse.ArgumentTypeError(f"tensor-parallel sizes must be among 1, 2, 4, got {text!r}")
    return vals


def _sizes(text: str) -> tuple[int, ...]:
    """``--batches`` / ``--lengths`` of ``fleetbatch planner profile``: distinct positive integers."""
    vals = _int_set(text, "grid sizes", "8,16,32")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"grid sizes must be positive integers like 8,16,32, got {text!r}")
    return vals


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def out_folder(path: str | Path) -> None:
    """Make the folder of an ``--out`` file (before the work, so a path that cannot be written is named at once)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"--out {path}: cannot make its folder: {e.strerror or e}") from None


@contextmanager
def writing(what: str, path: str | Path) -> Iterator[None]:
    """An ``OSError`` while writing ``path`` as a :class:`CliError` that names it (``what``: the option)."""
    try:
        yield
    except OSError as e:
        raise CliError(f"{what} {path}: cannot write it: {e.strerror or e}") from None
