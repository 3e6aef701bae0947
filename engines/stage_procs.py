"""The stage processes of a pipeline as its driver sees them: how they start (:func:`stage_context`), the
watchdog that finds one dead (:class:`StageWatch`), and how they are stopped (:func:`kill_stages`)."""

from __future__ import annotations

import itertools
import logging
import threading

import torch.multiprocessing as mp
from torch import nn

log = logging.getLogger(__name__)

#: the most tensors a stage's layers may hold to start from the fork server: each tensor travels to the
#: child as a file descriptor, and the fork server takes at most 256 descriptors per start
#: (``multiprocessing.forkserver.MAXFDS_TO_SEND``); a stage with more is spawned
FORK_SERVER_MAX_TENSORS = 200


def shared_tensors(part: nn.Module) -> int:
    """How many tensors (parameters and buffers, none empty) ``part`` shares with a stage process."""
    return sum(1 for t in itertools.chain(part.parameters(), part.buffers()) if t.numel())


def stage_context(part: nn.Module, *modules: str):
    """How the stage holding ``part`` starts: forked by this process's fork server, which imports the stage's
    code and ``modules`` (the model's classes) once: a fraction of a second of CPU where a spawn takes about
    4 s. The server never runs a model or touches a GPU, so its forks are as safe as a spawn (a fork of the
    driver is not). A server already running is used as it is (a deployment's engine forks its own from itself
    as it starts, with this code imported: ``gateway/deploy/forked.py``). A part of more than
    ``FORK_SERVER_MAX_TENSORS`` tensors is spawned."""
    if shared_tensors(part) > FORK_SERVER_MAX_TENSORS:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["engines.stage_worker", *modules])  # read when the server starts: once
    return ctx


def kill_stages(procs: list) -> None:
    """Kill the stage processes still alive and reap them."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


class StageWatch:
    """A daemon thread polling the stage processes: the first that dies is named in ``failure`` and the
    others are killed (which unblocks the driver's pending receive). It holds the processes, never the
    runner: a runner freed by this thread while the interpreter exits aborted the process (the posted
    receives' destructor takes the GIL in a thread that finalization ends; see docs/design/engine.md)."""

    def __init__(self, names: list[str], procs: list, poll_s: float = 0.2) -> None:
        self.failure: str | None = None
        self.found = threading.Event()  # set once ``failure`` names the stage that died
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(names, procs, poll_s), name="stage-watchdog", daemon=True
        )
        self._thread.start()

    def _run(self, names: list[str], procs: list, poll_s: float) -> None:
        while not self._stopped.is_set():
            for name, p in zip(names, procs, strict=True):
                if not p.is_alive() and not self._stopped.is_set():
                    code = p.exitcode
                    how = (
                        f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                    )
                    self.failure = f"{name}, pid {p.pid}, died ({how})"
                    self.found.set()
                    log.error("pipeline %s; stopping the other stages", self.failure)
                    kill_stages(procs)
                    return
            self._stopped.wait(poll_s)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        """Stop watching (a stage that exits from now on is not a failure) and wait for the thread."""
        self._stopped.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()


def stop_stages(watch: StageWatch, procs: list) -> None:
    """Stop watching, then kill the stages still alive: a runner freed (or left at exit) without ``close``."""
    watch.stop()
    kill_stages(procs)
