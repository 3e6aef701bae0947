"""Engines forked by a fork server: the interpreter that imports the engine's code (torch, transformers)
once for a deployment's engines, their restarts and their pipelines' stages, where each ``python -m engines.cli
serve`` imported it afresh (about 4 s of CPU an engine) and started a fork server of its own for its stages.

The server is :mod:`multiprocessing`'s: a fresh interpreter started (fork and exec) by the first
engine's start; it forks the engines, so none is forked beside ``fleetbatch gateway up``'s gRPC threads. An engine
gets SIGTERM when ``fleetbatch gateway up`` ends (:func:`workqueue.embedded.on_exit_of`; the server, whose
liveness pipe each engine holds, ends after them). A forked engine starts a session of its own, writes
to its log, gets the environment ``fleetbatch gateway up`` gives it (the Redis URL: never on a command line) and
shows its command line (without secrets) to ``ps`` as a spawned one did. It ends with ``os._exit``
(no ``atexit`` handlers run; none of the engine's code relies on them), and imports the starting
program's ``__main__`` (``gateway.cli``; ``load.cli`` under ``fleetbatch loadgen chaos``) as ``multiprocessing``
does. Its exit code is read from the server; whether it still runs, from its pidfd: were the server
killed on its own, its pipe would read as exit 255, and a running engine would be restarted beside itself.
:class:`EngineProcess` gives the supervisor and the chaos harness the part of :class:`subprocess.Popen`
they use.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import select
import signal
import subprocess
import sys
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing import forkserver, resource_tracker

import setproctitle

from workqueue.embedded import PARENT_ENV, on_exit_of

#: what the fork server imports once: the engine's code (and so its pipeline's stages', which it forks too)
PRELOAD = ("engines.cli", "engines.stage_worker")


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (``None`` where it has ended already or there are no pidfds)."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def _ended(pidfd: int, timeout_s: float | None = 0.0) -> bool:
    """Whether the process of ``pidfd`` has ended, waiting up to ``timeout_s`` (``None``: until it has)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else max(0.0, timeout_s) * 1000))


def _server_address() -> str:
    """The socket address of this process's fork server, started now if it is not running yet (multiprocessing
    keeps it private; its children inherit only the server's liveness pipe)."""
    forkserver.ensure_running()
    return forkserver._forkserver._forkserver_address  # type: ignore[attr-defined]


def _share_server(address: str) -> None:
    """In a forked engine: its own fork-server starts (its pipeline's stages, :mod:`engines.stage_procs`) go to
    the server that forked it, which has imported the engine's code already, instead of starting a server of
    its own (an interpreter that imports torch and the model's code again: 2-3 s of CPU an engine, and as much
    at each restart). That server is this process's parent, so it runs while this process does: nothing to
    check or start (multiprocessing's check, a ``waitpid``, works only on a child). Its forks are as safe as
    before: the server has no threads and never runs a model."""
    server = forkserver._forkserver  # type: ignore[attr-defined]
    server._forkserver_address = address
    server._forkserver_pid = os.getppid()
    server.ensure_running = resource_tracker.ensure_running  # the server's liveness pipe came with the fork


def _run(argv: Sequence[str], env: Mapping[str, str], log_path: str, server: str | None = None) -> None:
    """The forked engine: ``argv`` is ``[python, "-m", module, *args]`` as a spawned engine's would be;
    ``server``: the fork server's address, which its stages are forked by (:func:`_share_server`)."""
    mp.current_process().daemon = False  # started daemonic (see EngineProcess); it starts its stages
    if server is not None:
        _share_server(server)
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
            target=_run,
            args=(self.args, dict(env), log_path, _server_address()),
            name="fleetbatch-engine",
            daemon=True,
        )
        self._p.start()
        self.pid: int = self._p.pid or 0
        self._pidfd = _pidfd(self.pid)
        if self._pidfd is not None:  # closed with this object, never while another thread may use it
            weakref.finalize(self, os.close, self._pidfd)

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        code = self._p.exitcode  # the server's report; 255 also when the server itself is gone
        if code is None or self._pidfd is None or _ended(self._pidfd):
            return code
        return None  # the server is gone, the engine runs on

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)  # at once when the server is gone: then the engine's own end is awaited
        if self._p.exitcode is not None and self._pidfd is not None:
            _ended(self._pidfd, timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended just now
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, sig)  # never a reused pid
                else:
                    os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
