"""How ``fleetbatch loadgen chaos`` tells that a killed engine came back (``load.chaos.faults``): real processes
killed by pid, heartbeats in a real Redis, a stand-in for the supervisor that restarts them.

A heartbeat the killed engine stamped while dying (after the harness noted the time of the kill,
before the signal landed) once counted as the new engine's: a restart whose new process never
heartbeat was counted as observed. Only a heartbeat stamped once the restart was seen counts."""

from __future__ import annotations

import subprocess
import time
from types import SimpleNamespace

import pytest

from load.chaos.bite import Bite
from load.chaos.faults import ProcessFaults
from workqueue import WorkQueue, connect

pytestmark = pytest.mark.fault

NAME = "c0"
SLEEP = ["sleep", "600"]  # a stand-in engine process: killed by pid, reaped, restarted


class Supervisor:
    """Restarts ``NAME``'s process once it died, as :class:`gateway.deploy.supervisor.EngineSupervisor` does.
    The dying process's last heartbeat lands meanwhile (stamped now: after the kill was sent); the new
    process heartbeats (written here for it) on every later check when ``new_heartbeats``."""

    def __init__(self, redis_url: str, new_heartbeats: bool):
        self.queue = WorkQueue(connect(redis_url))
        self.new_heartbeats = new_heartbeats
        self.restarted = False
        self.procs = {NAME: subprocess.Popen(SLEEP)}

    def check(self) -> None:
        if self.restarted:
            if self.new_heartbeats:
                self.queue.heartbeat(NAME, 30.0, worker=f"new {self.procs[NAME].pid}")
            return
        if self.procs[NAME].poll() is None:
            return
        self.queue.heartbeat(NAME, 30.0, worker="old, dying")
        self.procs[NAME] = subprocess.Popen(SLEEP)
        self.restarted = True

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()
            p.wait()


class Harness(ProcessFaults):
    def __init__(self, redis_url: str, supervisor: Supervisor):
        self.redis_url = redis_url
        self.engines = supervisor
        self.c = SimpleNamespace(restart_timeout_s=1.5)  # a bound: the answer does not depend on it
        self.restarts_observed = 0
        self.restarts_missed: list[str] = []

    def queue(self) -> WorkQueue:
        return WorkQueue(connect(self.redis_url))

    def _healed(self, bite: Bite) -> None:
        bite.healed_at = time.monotonic()

    def _wait(self, predicate, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.engines.check()
            if predicate():
                return True
            time.sleep(0.05)
        return False


@pytest.mark.parametrize("new_heartbeats", [False, True])
def test_a_restart_counts_only_once_the_new_process_heartbeats(redis_url, new_heartbeats):
    supervisor = Supervisor(redis_url, new_heartbeats)
    try:
        h = Harness(redis_url, supervisor)
        old = supervisor.procs[NAME].pid
        bite = h._kill_and_restart(NAME, Bite())
        assert supervisor.procs[NAME].pid != old  # the supervisor did restart it
        assert bite.evidence["restarted"] is new_heartbeats, bite.evidence
        assert (h.restarts_observed, h.restarts_missed) == ((1, []) if new_heartbeats else (0, [NAME]))
    finally:
        supervisor.close()
