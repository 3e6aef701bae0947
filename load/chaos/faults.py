"""The process and network faults of ``fleetbatch loadgen chaos``, each injected and healed on real processes and
sockets, each returning a :class:`load.chaos.bite.Bite`: the evidence that it bit, or why not.

* ``kill_engine`` / ``stop_engine``: SIGKILL / SIGSTOP an engine that holds leases (the run waits,
  bounded, for one; a wave already final is a miss). Evidence: its leases at the hit (> 0).
* ``kill_redis`` / ``redis_outage``: Redis down (1.5 s / ``outage_s``). Evidence: pings failed
  (over at least twice the lease, for the outage), a new server answers afterwards and every
  engine heartbeat to it; for the outage, every engine also logged a failed Redis call (redis-py
  retries for a few seconds, which can hide the short kill from the engines' logs).
* ``partition``: the proxy between the first cluster's engine and Redis cut (a blackhole by
  default). Evidence: > 0 connections frozen, held, dropped or refused, and that engine's
  heartbeat lapsed or it logged failed Redis calls.
* ``kill_gateway``: SIGKILL the replica a client streams from. Evidence: the client saw an
  error and received results again (or the batch's end) afterwards.

A killed engine counts as restarted only once the supervisor started a new process *and* that
process sent a heartbeat (:meth:`ProcessFaults._restart_observed`): the run does not guess from
counters the supervisor resets after a minute of stable running.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from load.chaos.bite import Bite, DownProbe, LogWatch

log = logging.getLogger(__name__)

TOKEN = "chaos-admin-token"
CLIENT_TOKEN = "chaos-client-token-0001"  # the batch client's Bearer token (as client "chaos")
BUSY_WAIT_S = 60.0  # how long a fault on a busy engine waits for one to hold a lease
#: the faults that need their wave still running when they fire, an engine holding a lease or the client's stream
#: open (each such wave keeps one row running long: load.chaos.waves.held)
HELD_WAVE_FAULTS = frozenset({"kill_engine", "stop_engine", "kill_gateway"})


class ProcessFaults:
    """Engine, Redis, network and gateway faults for :class:`load.chaos.run.Chaos` (which provides the
    deployment and the helpers ``_wait``, ``queue``, ``_batch_final``, ``_healed``)."""

    restarts_observed: int
    restarts_missed: list[str]
    affected: str | None  # the cluster a fault hit, if one: its recovery is its next result
    wave: str  # the batch id of the wave the fault fires on

    # ------------------------------------------------------------------ shared helpers

    def _hold(self, seconds: float, probe=None) -> None:
        """Sleep while the supervisor keeps being driven (and ``probe()`` runs on every poll)."""
        self._wait(lambda: probe() if probe is not None else False, seconds)

    def _heartbeat_since(self, name: str, since: float) -> bool:
        info = self.queue().clusters([name])[0]
        return info.alive and info.last_heartbeat > since

    def _alive(self, name: str) -> bool:
        return self.queue().clusters([name])[0].alive

    def _restart_observed(self, name: str, old_pid: int, bite: Bite) -> bool:
        """Wait (bounded) until the supervisor restarted engine ``name`` (the heal) and the new process
        heartbeats: a heartbeat stamped after the restart was seen, when the killed process was already
        reaped (one it wrote while dying, even after the kill was sent, does not count)."""
        if self._wait(lambda: self.engines.procs[name].pid != old_pid, self.c.restart_timeout_s):
            since = time.time()
            self._healed(bite)  # a new process runs
            back = self._wait(
                lambda: self.engines.procs[name].poll() is None and self._heartbeat_since(name, since),
                self.c.restart_timeout_s,
            )
            if back:
                self.restarts_observed += 1
                return True
        self.restarts_missed.append(name)
        log.error("chaos: engine %s was not restarted within %.0f s", name, self.c.restart_timeout_s)
        return False

    def _running(self) -> list:
        """Clusters whose engine runs (process up, heartbeat live, active)."""
        return [
            i
            for i in self.queue().clusters(self.names)
            if i.alive and i.state == "active" and self.engines.procs[i.name].poll() is None
        ]

    def _busy_engine(self) -> str | None:
        """The running engine holding the most leases, once one holds any (bounded wait); None when
        none did before the wave was final."""
        box: list[str] = []

        def found() -> bool:
            busy = [i for i in self._running() if i.inflight > 0]
            if busy:
                box.append(max(busy, key=lambda i: i.inflight).name)
                return True
            return self._batch_final(self.wave)

        self._wait(found, BUSY_WAIT_S)
        return box[0] if box else None

    def _inflight(self, name: str) -> int:
        return self.queue().clusters([name])[0].inflight

    def _all_engines_back(self, since: float) -> bool:
        return all(p.poll() is None for p in self.engines.procs.values()) and all(
            self._heartbeat_since(n, since) for n in self.names
        )

    def _logs(self) -> LogWatch:
        return LogWatch(self.c.run_dir / "logs", self.names)

    def _kill_and_restart(self, name: str, bite: Bite) -> Bite:
        """SIGKILL engine ``name``; evidence: its leases right after (a dead process keeps them)."""
        self.affected = name
        pid = self.engines.procs[name].pid
        os.kill(pid, signal.SIGKILL)
        bite.evidence.update(engine=name, leases_at_kill=self._inflight(name))
        log.warning(
            "chaos: SIGKILL engine %s (pid %d, %d leases)", name, pid, bite.evidence["leases_at_kill"]
        )
        bite.evidence["restarted"] = self._restart_observed(name, pid, bite)
        return bite

    # ------------------------------------------------------------------ engines

    def kill_engine(self) -> Bite:
        name = self._busy_engine()
        if name is None:
            return Bite().miss(f"no engine held a lease before wave {self.wave} was final")
        bite = self._kill_and_restart(name, Bite())
        return bite if bite.evidence["leases_at_kill"] > 0 else bite.miss(f"{name} held no lease when killed")

    def stop_engine(self) -> Bite:
        name = self._busy_engine()
        if name is None:
            return Bite().miss(f"no engine held a lease before wave {self.wave} was final")
        self.affected = name
        pid = self.engines.procs[name].pid
        os.kill(pid, signal.SIGSTOP)
        bite = Bite({"engine": name, "leases_at_stop": self._inflight(name)})
        log.warning("chaos: SIGSTOP engine %s for %.1f s (lease %.1f s)", name, self.c.stop_s, self.c.lease_s)
        self._hold(self.c.stop_s)
        os.kill(pid, signal.SIGCONT)
        self._healed(bite)
        resumed_at = time.time()
        self._wait(lambda: self._heartbeat_since(name, resumed_at), 120)
        if bite.evidence["leases_at_stop"] == 0:
            bite.miss(f"{name} held no lease when stopped")
        return bite

    # ------------------------------------------------------------------ Redis

    def _run_id(self) -> str:
        return self._read(lambda: self.queue().r.info("server")["run_id"], "")

    def _redis_down(self, hold_s: float, min_down_s: float, logged: bool) -> Bite:
        """Redis killed, down ``hold_s``, restarted on its data. Evidence: failed pings over at least
        ``min_down_s``, a new server (run_id), every engine heartbeating to it, and (``logged``) every
        engine logging a failed Redis call (a short kill can hide in redis-py's retries)."""
        logs = self._logs()
        probe = DownProbe(self.redis.url)
        run_id = self._run_id()
        self.redis.kill()
        self._hold(hold_s, lambda: probe.poll() and False)
        self.redis.restart()
        bite = Bite()
        self._healed(bite)
        back = time.time()
        engines_back = self._wait(lambda: self._all_engines_back(back), 120)
        saw = logs.saw()
        new_server = self._run_id() not in ("", run_id)
        bite.evidence.update(
            failed_pings=probe.failed, down_s=probe.down_s, new_server=new_server,
            engines_back=engines_back, engines_logged_errors=saw,
        )  # fmt: skip
        if probe.failed == 0 or probe.down_s < min_down_s:
            bite.miss(f"pings failed for {probe.down_s} s ({probe.failed} pings), not {min_down_s:g} s")
        if not new_server:
            bite.miss("the Redis answering afterwards is the same server")
        if not engines_back:
            bite.miss("not every engine heartbeat to the restarted Redis")
        missing = sorted(set(self.names) - set(saw))
        if logged and missing:
            bite.miss(f"engines {missing} logged no failed Redis call")
        return bite

    def kill_redis(self) -> Bite:
        log.warning("chaos: SIGKILL Redis")
        return self._redis_down(1.5, 0.0, logged=False)

    def redis_outage(self) -> Bite:
        """Redis down for ``outage_s`` (at least twice the lease), then back on its data."""
        log.warning("chaos: Redis down for %.1f s (lease %.1f s)", self.c.outage_s, self.c.lease_s)
        return self._redis_down(self.c.outage_s, 2 * self.c.lease_s - 1.0, logged=True)

    # ------------------------------------------------------------------ network

    def partition(self) -> Bite:
        """Cut the proxy between the first cluster's engine and Redis for ``partition_s``."""
        name = self.affected = self.names[0]
        logs = self._logs()
        before = self.proxy.stats()
        lapsed: list[bool] = []
        live = self.proxy.cut(self.c.partition_mode)
        log.warning(
            "chaos: partition %s <-> Redis (%s) for %.1f s (%d live connections)",
            name, self.c.partition_mode, self.c.partition_s, live,
        )  # fmt: skip
        self._hold(self.c.partition_s, lambda: lapsed.append(True) if not self._alive(name) else False)
        self.proxy.heal()
        bite = Bite()
        self._healed(bite)
        healed = time.time()
        self._wait(lambda: self._heartbeat_since(name, healed), 120)
        after = self.proxy.stats()
        hit = {k: after[k] - before[k] for k in ("blackholed", "held_connects", "dropped", "refused")}
        saw = name in logs.saw()
        bite.evidence.update(mode=self.c.partition_mode, connections=hit, heartbeat_lapsed=bool(lapsed))
        bite.evidence["engine_redis_errors"] = saw
        if not any(hit.values()):
            bite.miss("no connection was frozen, held, dropped or refused")
        if not lapsed and not saw:
            bite.miss(f"{name}'s heartbeat never lapsed and it logged no failed Redis call")
        return bite

    # ------------------------------------------------------------------ gateways

    def kill_gateway(self) -> Bite:
        """SIGKILL the replica the current wave's client streams from, then restart it on its ports."""
        client = self.clients[-1]
        g = next(g for g in self.gateways if g.address == client.target)
        errors, received = sum(client.errors.values()), len(client.results)
        g.kill()
        log.warning("chaos: SIGKILL gateway %s", g.name)
        self._hold(1.0)
        g.start()
        bite = Bite({"gateway": g.name})
        self._healed(bite)

        def resumed() -> bool:
            saw = sum(client.errors.values()) > errors
            return saw and (len(client.results) > received or client.final is not None)

        ok = self._wait(resumed, self.c.settle_s)
        bite.evidence.update(client_errors=sum(client.errors.values()) - errors, resumed=ok)
        if client.final is not None and not ok and sum(client.errors.values()) == errors:
            return bite.miss("the client's stream had already ended when its gateway was killed")
        return bite if ok else bite.miss("the client saw no error, or did not resume after it")
