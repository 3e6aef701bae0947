"""The engine processes of ``fleetbatch gateway up``: start them, restart one that dies, stop them all.

* **Restarts.** An engine that crashes (exits non-zero or by a signal) is started again after a
  backoff (1 s, doubling up to 30 s; reset once it has run for a minute), at most
  ``max_restarts`` times per engine. Its claimed queries come back through their leases and
  its queued work is moved by the offloader meanwhile, so a restart loses nothing. An engine that
  stopped by itself (exit 0: after a preemption notice, a SIGTERM) is started again, after
  ``backoff_base_s`` and counted as a restart, once its cluster is ``active`` (a preempted cluster is
  ``draining`` until ``gateway rebalance --add C --update``); one whose cluster is draining or removed stays
  stopped. ``wanted`` reads whether a cluster is active (under ``gateway up``, its state in Redis); it is
  called in a thread, off the gateway's event loop.
* **No orphans.** An engine (forked by the fork server of :mod:`gateway.deploy.forked`) gets SIGTERM
  when ``fleetbatch gateway up`` ends, and the embedded Redis (:mod:`workqueue.embedded`) from the kernel
  (``PR_SET_PDEATHSIG``), so a SIGKILL of ``fleetbatch gateway up`` leaves no engine or Redis behind.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from clusterfile import ENDPOINT_BACKEND
from gateway.config import ClusterSpec
from gateway.deploy.forked import EngineProcess
from workqueue.embedded import PARENT_ENV, URL_ENV

log = logging.getLogger(__name__)


def engine_command(spec: ClusterSpec, threads: int, extra: Sequence[str]) -> list[str]:
    """``fleetbatch engine serve`` for ``spec``; the Redis URL goes in its environment (:func:`engine_env`),
    never on its command line, which every user of the host can read."""
    return [
        sys.executable, "-m", "engines.cli", "serve",
        "--cluster", spec.name,
        "--backend", spec.backend,
        "--threads", str(threads),
        "--capacity", str(spec.capacity_tps),
        *(["--plan", spec.plan] if spec.plan else []),
        *model_arguments(spec),
        *spec.engine_args,
        *extra,
    ]  # fmt: skip


def model_arguments(spec: ClusterSpec) -> list[str]:
    """The cluster file's ``served_model`` and ``endpoints`` as ``fleetbatch engine serve`` flags: the
    endpoint backend's servers and the model's name there, or the model directory another backend loads."""
    if spec.backend == ENDPOINT_BACKEND:
        urls = [flag for url in spec.endpoints for flag in ("--endpoint-url", url)]
        return urls + (["--served-model-name", spec.served_model] if spec.served_model else [])
    return ["--served-model", spec.served_model] if spec.served_model else []


def engine_env(redis_url: str) -> dict[str, str]:
    """The engine's environment: the Redis URL, and this process as the one it must not outlive."""
    return dict(os.environ, PYTHONUNBUFFERED="1", **{URL_ENV: redis_url, PARENT_ENV: str(os.getpid())})


@dataclass
class EngineSupervisor:
    """One ``fleetbatch engine serve`` process per cluster spec, kept running until :meth:`stop`."""

    specs: Sequence[ClusterSpec]
    redis_url: str
    log_dir: Path
    threads: int = 1
    extra: Sequence[str] = ()
    max_restarts: int = 5
    backoff_base_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_s: float = 60.0  # an engine up this long has its backoff reset
    on_change: Callable[[dict[str, int]], None] | None = None  # told the pids after a restart
    #: whether a cluster is active, asked of those whose engine stopped by itself (None: never asked)
    wanted: Callable[[str], bool] | None = None
    procs: dict[str, EngineProcess] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    _started_at: dict[str, float] = field(default_factory=dict)
    _due: dict[str, float] = field(default_factory=dict)

    def start_all(self) -> None:
        for spec in self.specs:
            self._start(spec)

    def _start(self, spec: ClusterSpec) -> None:
        self.procs[spec.name] = EngineProcess(
            engine_command(spec, self.threads, self.extra),
            engine_env(spec.redis_url or self.redis_url),  # a spec's own URL: e.g. through a proxy
            str(self.log_dir / f"engine-{spec.name}.log"),
        )
        self._started_at[spec.name] = time.monotonic()
        log.info("engine %s started (pid %d, backend %s)", spec.name, self.procs[spec.name].pid, spec.backend)

    @property
    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    def exited(self) -> dict[str, int]:
        """Engines that have exited, with their exit codes."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def _states(self, names: list[str]) -> dict[str, bool]:
        """Whether each of these clusters is active (``wanted``; run in a thread: it may read Redis)."""
        wanted = self.wanted
        return {n: wanted is not None and wanted(n) for n in names}

    def stopped_by_themselves(self) -> list[str]:
        """Engines that exited 0 and are not due to start again (whose clusters :meth:`check` asks about)."""
        return [n for n, p in self.procs.items() if p.poll() == 0 and n not in self._due]

    def check(self, now: float | None = None, active: Mapping[str, bool] | None = None) -> list[str]:
        """Restart engines that died and whose backoff is over, and those that stopped by themselves whose cluster
        is back (``active``: whether each such engine's cluster is active now, from ``wanted``; absent: not
        asked); returns the names restarted."""
        now = time.monotonic() if now is None else now
        restarted = []
        for spec in self.specs:
            name, p = spec.name, self.procs[spec.name]
            if p.poll() is None:
                if now - self._started_at[name] > self.stable_s:
                    self.restarts[name] = 0
                continue
            if name not in self._due:
                n = self.restarts.get(name, 0)
                if n >= self.max_restarts:
                    continue
                if p.returncode == 0:  # it chose to stop (a notice, SIGTERM, removed): not a crash
                    if not (active or {}).get(name):
                        continue
                    self._due[name] = now + self.backoff_base_s
                    log.info("engine %s stopped by itself and its cluster is active again: starting it", name)
                else:
                    delay = min(self.backoff_max_s, self.backoff_base_s * 2**n)
                    self._due[name] = now + delay
                    log.error(
                        "engine %s exited with code %s; restarting it in %.0f s (restart %d of %d); "
                        "its queued work moves to the others meanwhile",
                        name, p.returncode, delay, n + 1, self.max_restarts,
                    )  # fmt: skip
            if now >= self._due[name]:
                del self._due[name]
                self.restarts[name] = self.restarts.get(name, 0) + 1
                try:
                    self._start(spec)
                except (
                    OSError,
                    EOFError,
                ) as e:  # counted as a restart; the next check tries again after a backoff
                    log.error("engine %s could not be restarted: %s", name, e)
                    continue
                restarted.append(name)
        if restarted and self.on_change is not None:
            self.on_change(self.pids)
        return restarted

    async def watch(self, stop: asyncio.Event, interval_s: float = 0.5) -> None:
        given_up: set[str] = set()
        while not stop.is_set():
            names = self.stopped_by_themselves() if self.wanted is not None else []
            active = await asyncio.to_thread(self._states, names) if names else None
            self.check(active=active)
            for name, code in self.exited().items():
                if code != 0 and self.restarts.get(name, 0) >= self.max_restarts and name not in given_up:
                    given_up.add(name)
                    log.error(
                        "engine %s exited with code %s after %d restarts; not restarting it",
                        name,
                        code,
                        self.max_restarts,
                    )
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass

    def stop(self, timeout_s: float = 15.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, p in self.procs.items():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("engine %s did not stop in time; killing it", name)
                p.kill()
                p.wait()
