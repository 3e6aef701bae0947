"""Engines forked by a fork server: the interpreter that imports the engine's code (torch, transformers)
once for a deployment's engines and their restarts, where each ``python -m engines.cli serve`` imported it afresh
(about 4 s of CPU an engine); each engine's own fork server for its pipeline's stages is forked from the engine
as it starts, not started afresh (:func:`_fork_stage_server`).

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
import inspect
import logging
import multiprocessing as mp
import os
import select
import signal
import socket
import subprocess
import sys
import traceback
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing import connection, forkserver
from typing import NoReturn

import setproctitle

from workqueue.embedded import PARENT_ENV, on_exit_of

log = logging.getLogger(__name__)

#: what the fork server imports once: the engine's code and its pipeline stages' (each engine's stage server is
#: a fork of an engine: :func:`_fork_stage_server`)
PRELOAD = ("engines.cli", "engines.stage_worker")
#: the parameters of ``multiprocessing.forkserver.main`` (3.11-3.13) that :func:`_fork_stage_server` passes
_MAIN_PARAMETERS = {"listener_fd", "alive_r", "preload", "main_path", "sys_path"}


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


def _fork_stage_server() -> None:
    """In a forked engine, before anything else runs: its own fork server (for its pipeline's stages,
    :mod:`engines.stage_procs`), forked from this process rather than started as a fresh interpreter that
    imports torch and the model's code again (2-3 s of CPU an engine, and at each restart). Now, as a fork of
    the deployment's server, this process has the engine's code imported, no thread and no model run, so the
    fork is as safe as the server's own; it already has the engine's log, environment and session, so the
    stages do too. Registered as multiprocessing's own server would be (it is this process's child: if it dies,
    multiprocessing starts a fresh one as before). Where ``multiprocessing.forkserver.main`` takes more than
    this (Python 3.14 authenticates its clients with a key), the server is started as before."""
    server = forkserver._forkserver  # type: ignore[attr-defined]  # multiprocessing's one instance
    if set(inspect.signature(forkserver.main).parameters) != _MAIN_PARAMETERS:
        return
    try:
        address, alive_w, pid = _start_server(server._forkserver_alive_fd)
    except OSError as e:  # no socket, pipe or fork now: the first stage start runs the stock server
        log.warning("could not fork the stage fork server (%s); a stage start will start one", e)
        return
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def _start_server(inherited_alive_fd: int | None) -> tuple[str, int, int]:
    """Fork a fork server as ``ForkServer.ensure_running`` sets its up; its address, liveness pipe and pid."""
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # every client holds the write end; the server ends at its EOF
        try:
            pid = os.fork()
        except OSError:
            os.close(alive_r)
            os.close(alive_w)
            raise
        if pid == 0:  # the server: never returns
            _serve(listener.fileno(), alive_r, alive_w, inherited_alive_fd, address)
        os.close(alive_r)
    return address, alive_w, pid


def _serve(
    listener_fd: int, alive_r: int, alive_w: int, inherited_alive_fd: int | None, address: str
) -> NoReturn:
    """The forked server's life: multiprocessing's server loop until its last client is gone, then exit."""
    code = 1
    try:
        setproctitle.setproctitle(f"{setproctitle.getproctitle()} [stage fork server]")
        os.close(alive_w)
        if inherited_alive_fd is not None:  # the deployment server's: this server is not its client
            os.close(inherited_alive_fd)
        forkserver.main(listener_fd, alive_r, [])
    except SystemExit:  # its clients are gone
        code = 0
    except BaseException:
        traceback.print_exc()  # to the engine's log
    finally:
        with contextlib.suppress(OSError):
            os.unlink(address)
        os._exit(code)


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
    _fork_stage_server()  # with the log, environment and session set, before the first thread
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
            args=(self.args, dict(env), log_path),
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
