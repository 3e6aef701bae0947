"""The spot benchmark's events on a running ``fleetbatch gateway up``: a hard kill, preemption notices, clusters back.

:class:`SpotEvents` is told the batch's progress (rows done) and fires each :class:`Event` once its share
of the rows is done, each in a thread of its own:

* ``kill``: SIGKILL of the cluster's engine by pid (``gateway.json``'s ``engine_pids``, read again: the
  deployment's supervisor restarts a killed engine and writes its new pid). The queries it ran come
  back when their leases lapse, each from its last checkpoint.
* ``preempt``: ``DrainCluster(preempt=True, notice_s)`` (``fleetbatch gateway rebalance --preempt C --notice S
  --apply``). Once the engine has stopped, and ``back_after_s`` later, the cluster is made active again
  (``AddCluster(update=True)``: ``rebalance --add C --update --apply``), and the deployment's supervisor starts
  its engine again (it does for a cluster active again whose engine stopped by itself): the event waits for the
  new pid in ``gateway.json``.

What each event saw is kept for the recompute accounting (:mod:`load.studies.spot_stats`): the queries
in the cluster's in-flight set just before it, and the tokens of each one's partial output as it left
(read every 0.1 s while the engine stops; after a kill, at once: nothing writes them until their leases
lapse). :class:`HeartbeatLog` keeps each engine's cumulative ``generated_tokens`` from its heartbeats.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from protos import fleetbatch_pb2 as pb
from workqueue import connect, keys
from workqueue.partial import Partial

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    at: float  # share of the batch's rows done
    kind: str  # kill | preempt
    cluster: str


@dataclass
class Seen:
    """What one event saw: when, the queries running on the cluster then, each one's partial output as it left."""

    event: Event
    t: float = 0.0  # when it was fired (unix seconds)
    stopped_t: float = 0.0  # when its engine was gone
    back_t: float = 0.0  # when the cluster was active again with an engine
    running: list[str] = field(default_factory=list)  # gids in flight on the cluster just before
    partial: dict[str, int] = field(default_factory=dict)  # gid -> tokens of its partial output as it left


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


class SpotEvents:
    """Fires the events on the deployment ``info`` (``gateway.json``) as the batch progresses."""

    def __init__(self, info: dict, run_dir: Path, events: list[Event], notice_s: float, back_after_s: float):
        self.info, self.run_dir = info, run_dir
        self.events = sorted(events, key=lambda e: e.at)
        self.notice_s, self.back_after_s = notice_s, back_after_s
        self.r = connect(info["redis_url"])
        token = Path(info["admin_token_file"]).read_text().strip()
        self.md = [("authorization", f"Bearer {token}")]
        self.commands = {n: self._cmdline(p) for n, p in info["engine_pids"].items()}
        self.seen: list[Seen] = []
        self._threads: list[threading.Thread] = []
        self._busy: set[str] = set()  # clusters with an event under way
        self._lock = threading.Lock()
        self._admin = None
        self._capacity: dict[str, float] = {}
        self._dead: dict[str, dict[str, float]] = {}  # a killed engine's queries, by their lease then

    @staticmethod
    def _cmdline(pid: int) -> list[str]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode() for a in f.read().split(b"\0") if a]
        return shlex.split(args[0]) if len(args) == 1 else args  # a forked engine's title is one string

    def _pid(self, cluster: str) -> int:
        info = json.loads((Path(self.info["logs"]).parent / "gateway.json").read_text())
        return int(info["engine_pids"][cluster])

    def attach(self, admin_stub) -> None:
        """The admin stub the events use; each cluster's capacity now (its plan's) is the one it comes back with."""
        self._admin = admin_stub
        resp = admin_stub.GetClusterStatus(pb.ListClustersRequest(), metadata=self.md, timeout=30)
        self._capacity = {c.name: c.plan_tokens_per_s or c.capacity_tokens_per_s for c in resp.clusters}

    def progress(self, share: float) -> None:
        """Fire every event due at ``share`` of the rows done whose cluster has no event under way."""
        while self.events and self.events[0].at <= share:
            e = self.events[0]
            with self._lock:
                if e.cluster in self._busy:
                    return  # its cluster is not back yet: the event waits
                self._busy.add(e.cluster)
            self.events.pop(0)
            seen = Seen(e, t=time.time())
            self.seen.append(seen)
            target = self._kill if e.kind == "kill" else self._preempt
            t = threading.Thread(target=target, args=(seen,), name=f"spot-{e.kind}-{e.cluster}", daemon=True)
            t.start()
            self._threads.append(t)

    def _leases(self, cluster: str) -> dict[str, float]:
        rows = self.r.zrange(keys.inflight(cluster), 0, -1, withscores=True)
        return {g if isinstance(g, str) else g.decode(): float(s) for g, s in rows}

    def _inflight(self, cluster: str) -> list[str]:
        """The queries a live engine of the cluster holds: those a killed engine held stay in flight, their leases
        unrenewed, until they lapse; they are left out."""
        dead = self._dead.get(cluster, {})
        return [g for g, s in self._leases(cluster).items() if dead.get(g) != s]

    def _partials(self, gids: list[str]) -> list[int | None]:
        pipe = self.r.pipeline(transaction=False)
        for g in gids:
            pipe.hget(keys.query(g), keys.PARTIAL)
        out = []
        for raw in pipe.execute():
            p = Partial.decode(raw)
            out.append(len(p) if p is not None else 0)
        return out

    def _kill(self, seen: Seen) -> None:
        c = seen.event.cluster
        pid = self._pid(c)
        self._dead[c] = self._leases(c)
        seen.running = list(self._dead[c])
        os.kill(pid, signal.SIGKILL)
        seen.stopped_t = time.time()
        seen.partial = dict(zip(seen.running, self._partials(seen.running), strict=True))
        while not _gone(pid):
            time.sleep(0.1)
        self._wait_engine(c, pid)
        seen.back_t = time.time()
        with self._lock:
            self._busy.discard(c)

    def _wait_engine(self, cluster: str, old_pid: int, limit_s: float = 120.0) -> None:
        """Until the supervisor has started the cluster's engine again (a new pid in ``gateway.json``)."""
        give_up = time.monotonic() + limit_s
        while time.monotonic() < give_up:
            try:
                if self._pid(cluster) != old_pid:
                    return
            except (json.JSONDecodeError, KeyError, FileNotFoundError):
                pass
            time.sleep(0.2)
        log.warning(
            "cluster %s: no new engine %.0f s after it was back; its return is counted from now",
            cluster,
            limit_s,
        )

    def _preempt(self, seen: Seen) -> None:
        c = seen.event.cluster
        pid = self._pid(c)
        seen.running = self._inflight(c)
        req = pb.DrainClusterRequest(name=c, dry_run=False, preempt=True, notice_s=self.notice_s)
        self._admin.DrainCluster(req, metadata=self.md, timeout=30)
        left: dict[str, int] = {}
        last = dict.fromkeys(seen.running, 0)
        while not _gone(pid) or len(left) < len(seen.running):
            now_in = set(self._inflight(c))
            gids = [g for g in seen.running if g not in left]
            for g, n in zip(gids, self._partials(gids), strict=True):
                if g in now_in:
                    last[g] = n
                else:  # it left: finished here (no partial output left) or given back with its partial output
                    left[g] = n
            if _gone(pid) and len(left) < len(seen.running):
                for g in gids:
                    left.setdefault(g, last[g])
            time.sleep(0.1)
        seen.stopped_t = time.time()
        seen.partial = left
        time.sleep(self.back_after_s)
        req_add = pb.AddClusterRequest(name=c, update=True, capacity_tokens_per_s=self._capacity.get(c, 0.0))
        self._admin.AddCluster(req_add, metadata=self.md, timeout=30)
        self._wait_engine(c, pid)
        seen.back_t = time.time()
        with self._lock:
            self._busy.discard(c)

    def join(self, timeout_s: float = 180.0) -> None:
        give_up = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, give_up - time.monotonic()))


class HeartbeatLog:
    """Each cluster's engine's cumulative ``generated_tokens``, read from its heartbeat every ``interval_s``; a
    counter that drops is a new engine process. :meth:`processes` gives each process's last figure."""

    def __init__(self, redis_url: str, clusters: list[str], interval_s: float = 0.25):
        self.r = connect(redis_url)
        self.clusters, self.interval_s = clusters, interval_s
        self.rows: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spot-heartbeats", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        for c in self.clusters:
            pipe.hget(keys.heartbeat(c), "generated_tokens")
        t = time.time()
        for c, raw in zip(self.clusters, pipe.execute(), strict=True):
            if raw is not None:
                self.rows.append((t, c, int(float(raw))))

    def __enter__(self) -> HeartbeatLog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def processes(self) -> list[dict]:
        """Per cluster, each engine process seen: ``{"cluster", "start", "end", "generated"}`` (first and last sample
        time, its last cumulative count)."""
        out: list[dict] = []
        current: dict[str, dict] = {}
        for t, c, n in self.rows:
            p = current.get(c)
            if p is None or n < p["generated"]:
                p = current[c] = {"cluster": c, "start": t, "end": t, "generated": n}
                out.append(p)
            p["end"], p["generated"] = t, n
        return out
