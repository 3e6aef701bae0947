"""Engines forked by a fork server: the interpreter that imports the engine's code (torch, transformers)
once for a deployment's engines and their restarts, where each ``python -m engines.cli serve`` imported
it afresh (about 4 s of CPU an engine).

The server is :mod:`multiprocessing`'s: a fresh interpreter started (fork and exec) by the first
engine's start; it forks the engines, so none is forked beside ``gateway up``'s gRPC threads. An engine
gets SIGTERM when ``gateway up`` ends (:func:`workqueue.embedded.on_exit_of`; the server, whose
liveness pipe each engine holds, ends after them). A forked engine starts a session of its own, writes
to its log, gets the environment ``gateway up`` gives it (the Redis URL: never on a command line) and
shows its command line (without secrets) to ``ps`` as a spawned one did. It ends with ``os._exit``
(no ``atexit`` handlers run; none of the engine's code relies on them), and imports the starting
program's ``__main__`` (``gateway.cli``; ``load.cli`` under ``loadgen chaos``) as ``multiprocessing``
does. Its exit code is read from the server: were the server killed on its own, a running engine
would read as exited (255) and be restarted beside itself (left: a pidfd per engine).
:class:`EngineProcess` gives the supervisor and the chaos harness the part of :class:`subprocess.Popen`
they use.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

import setproctitle

from workqueue.embedded import PARENT_ENV, on_exit_of

PRELOAD = ("engines.cli",)


def _run(argv: Sequence[str], env: Mapping[str, str], log_path: str) -> None:
    """The forked engine: ``argv`` is ``[python, "-m", module, *args]`` as a spawned engine's would be."""
    mp.current_process().daemon = False  # started daemonic (see EngineProcess); it starts its stages
    setproctitle.setproctitle(" ".join(argv))  # before the environment changes: it finds argv's memory by it
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update({k: v for k, v in env.items() if k != PARENT_ENV})
    on_exit_of(int(env[PARENT_ENV]), lambda: os.kill(os.getpid(), signal.SIGTERM))  # as PR_SET_PDEATHSIG did
    sys.argv = [argv[2], *argv[3:]]
    sys.exit(importlib.import_module(argv[2]).main(list(argv[3:])))


class EngineProcess:
    """A forked engine, with :class:`subprocess.Popen`'s ``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``terminate`` and ``kill`` (a signal's death reads as its negative number, as there)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], log_path: str) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*PRELOAD, __name__])  # read when the server starts: once
        self.args = list(argv)
        # daemonic: at this process's exit multiprocessing terminates engines still running rather than
        # waiting for them (they stop only when told, or when this process is gone)
        self._p = ctx.Process(
            target=_run, args=(self.args, dict(env), log_path), name="fleetbatch-engine", daemon=True
        )
        self._p.start()
        self.pid: int = self._p.pid or 0

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._p.exitcode

    def send_signal(self, sig: int) -> None:
        if self._p.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # it ended just now
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
