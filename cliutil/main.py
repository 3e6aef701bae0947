"""One ``main()`` for every console script.

Each CLI builds its parser and a function that runs the parsed command; :func:`run_main` does
the rest the same way everywhere::

    def main(argv: list[str] | None = None) -> int:
        return run_main(build_parser(), argv, run, prog="planner", levels=(logging.WARNING, logging.INFO))

``run`` returns the exit code, or (``print_json=True``) a result that is printed as one JSON
line, exit code 0. An error of one of the ``errors`` types becomes ``message`` on stderr and
``error_code``; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cliutil.config_file import resolve_config

TIMESTAMPED_LOG = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PLAIN_LOG = "%(levelname)s %(name)s: %(message)s"
#: ``fleetbatch -v``: debug logging in this process and every one it starts
VERBOSE_ENV = "FLEETBATCH_VERBOSE"
#: ``fleetbatch --log-format json|text``: how log lines look, in this process and every one it starts
LOG_FORMAT_ENV = "FLEETBATCH_LOG_FORMAT"


class JsonLogFormatter(logging.Formatter):
    """One JSON object a line: time (unix seconds), level, logger, message (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": round(record.created, 3), "level": record.levelname, "logger": record.name,
                "message": record.getMessage()}  # fmt: skip
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def _configure_logging(level: int, log_format: str) -> None:
    """The root logger on stderr, as text in ``log_format`` or as JSON lines (``$FLEETBATCH_LOG_FORMAT``)."""
    if os.environ.get(LOG_FORMAT_ENV) == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonLogFormatter())
        logging.basicConfig(level=level, handlers=[handler])
    else:
        logging.basicConfig(level=level, format=log_format, stream=sys.stderr)


def command_of(args: argparse.Namespace) -> str:
    """The subcommand's name (``args.command`` or ``args.cmd``), ``""`` without one."""
    return str(getattr(args, "command", None) or getattr(args, "cmd", None) or "")


def run_main(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    run: Callable[[argparse.Namespace], Any],
    *,
    prog: str,
    errors: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, OSError),
    error_code: int = 1,
    message: str = "{prog}{command}: error: {error}",
    describe: Callable[[BaseException], str] = str,
    log_format: str | None = TIMESTAMPED_LOG,
    levels: tuple[int, int] = (logging.INFO, logging.DEBUG),
    quiet_loggers: Sequence[str] = (),
    print_json: bool = False,
    json_default: Callable[[Any], Any] | None = None,
    interrupted_code: int | None = None,
) -> int:
    """Parse ``argv`` with ``parser``, set up logging, run ``run(args)``; returns the exit code.

    - Logging: ``levels`` = (level without ``-v``, level with ``-v``/``--verbose`` or ``$FLEETBATCH_VERBOSE``)
      in ``log_format`` on stderr (JSON lines with ``$FLEETBATCH_LOG_FORMAT=json``). A parser without
      ``-v`` (unless the variable is set), or ``log_format=None``, leaves logging alone. ``quiet_loggers``
      (noisy libraries) log errors only.
    - Exit status: argparse's 2 for a usage error; ``error_code`` (1) for every other failure.
    - Errors: ``message`` is formatted with ``prog``, ``command`` (the subcommand after a space,
      :func:`command_of`; empty without one) and ``error`` (``describe(exception)``, ``str`` by
      default).
    - ``interrupted_code``: Ctrl-C prints ``PROG: interrupted`` and returns this code (``None``:
      the ``KeyboardInterrupt`` propagates).
    """
    args = parser.parse_args(argv)
    verbose = getattr(args, "verbose", None)
    if os.environ.get(VERBOSE_ENV) == "1":
        verbose = True
    if log_format is not None and verbose is not None:
        _configure_logging(levels[bool(verbose)], log_format)
        for name in quiet_loggers:
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        result = run(resolve_config(args))  # options a command takes from the environment or --config-file
    except errors as e:
        command = f" {command_of(args)}" if command_of(args) else ""
        print(message.format(prog=prog, command=command, error=describe(e)), file=sys.stderr)
        return error_code
    except KeyboardInterrupt:
        if interrupted_code is None:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return interrupted_code
    if print_json:
        print(json.dumps(result, default=json_default))
        return 0
    return result
