"""Run (b)'s processes for ``fleetbatch loadgen endpoints``: an embedded Redis, ``fleetbatch gateway serve``
(counting in the served model's tokenizer) and ``fleetbatch engine serve --backend endpoint``, each
pinned to the client's cores, their logs in the run directory, stopped by their pids."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from clusterfile import dump_cluster_file
from gateway.grpc_api.auth import TOKENS_ENV
from workqueue import WorkQueue, connect
from workqueue.embedded import URL_ENV, EmbeddedRedis

CLUSTER = "ep"


def pin_threads(pid: int, cpus) -> None:
    """Pin every thread of process ``pid`` to ``cpus`` (an affinity is a thread's own; its children inherit it)."""
    if not cpus:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), set(cpus))
        except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
            pass


def _stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


class Deployment:
    """Redis, the gateway and one endpoint engine (see the module's docstring); ``address`` is the gateway's."""

    def __init__(self, run_dir: Path, model: Path, endpoint_url: str, token: str, args, cpus) -> None:
        self.run_dir, self.model, self.endpoint_url, self.token = run_dir, model, endpoint_url, token
        self.args, self.cpus = args, cpus
        self.redis: EmbeddedRedis | None = None
        self.procs: list[subprocess.Popen] = []
        self.address = ""
        self.inflight: list[
            int
        ] = []  # the engine's requests in flight, from its heartbeats while it had some
        self._sampling = threading.Event()

    def __enter__(self) -> Deployment:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        self.redis = EmbeddedRedis(self.run_dir / "redis", persist=False)
        pin_threads(self.redis.pid, self.cpus)
        url = self.redis.url
        dump_cluster_file(self.run_dir / "clusters.yaml", [{"name": CLUSTER, "capacity_tps": 100}])
        env = dict(os.environ, **{URL_ENV: url, TOKENS_ENV: f"endpoints:{self.token}"}, PYTHONUNBUFFERED="1")
        gateway = [
            sys.executable, "-m", "gateway.cli", "serve", "--listen", "127.0.0.1:0",
            "--clusters", str(self.run_dir / "clusters.yaml"), "--no-offload",
            "--predictor", self.args.predictor, "--served-model", str(self.model),
        ]  # fmt: skip
        proc = subprocess.Popen(gateway, stderr=subprocess.PIPE, text=True, env=env)
        self.procs.append(proc)
        pin_threads(proc.pid, self.cpus)
        self.address = self._listening(proc)
        engine = [
            sys.executable, "-m", "engines.cli", "serve", "--cluster", CLUSTER, "--redis-url", url,
            "--backend", "endpoint", "--endpoint-url", self.endpoint_url, *self.args.engine_arg,
        ]  # fmt: skip
        log = open(self.run_dir / "engine.log", "ab")  # noqa: SIM115 - the child's
        self.procs.append(subprocess.Popen(engine, stdout=log, stderr=subprocess.STDOUT, env=env))
        log.close()
        pin_threads(self.procs[-1].pid, self.cpus)
        queue = WorkQueue(connect(url))
        deadline = time.monotonic() + 120
        while not [i for i in queue.clusters([CLUSTER]) if i.alive and i.served_model is not None]:
            if self.procs[-1].poll() is not None:
                raise RuntimeError(
                    f"the engine exited ({self.procs[-1].returncode}); see {self.run_dir}/engine.log"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine did not register in 120 s; see {self.run_dir}/engine.log")
            time.sleep(0.1)
        threading.Thread(target=self._sample, args=(queue,), daemon=True).start()

    def _sample(self, queue: WorkQueue) -> None:
        """The engine's requests in flight, as its heartbeat says, twice a second."""
        while not self._sampling.wait(0.5):
            try:
                running = sum(i.running for i in queue.clusters([CLUSTER]))
            except Exception:  # Redis stopping: the run is over
                return
            if running:
                self.inflight.append(running)

    def _listening(self, proc: subprocess.Popen) -> str:
        """The gateway's address, from its log line; the rest of its log goes on to gateway.log."""
        log = open(self.run_dir / "gateway.log", "a")  # noqa: SIM115 - the drain thread's
        for line in proc.stderr:
            log.write(line)
            m = re.search(r"gateway listening on (\S+)", line)
            if m:
                threading.Thread(target=lambda: [log.write(x) for x in proc.stderr], daemon=True).start()
                return m.group(1)
        log.close()
        raise RuntimeError(f"fleetbatch gateway serve exited ({proc.wait()}); see {self.run_dir}/gateway.log")

    def results(self, batch_id: str) -> list[dict]:
        """Every result record the engine wrote for the batch (from Redis: a row written twice shows twice)."""
        assert self.redis is not None
        return WorkQueue(connect(self.redis.url)).results(batch_id)

    def close(self) -> None:
        self._sampling.set()
        for proc in reversed(self.procs):
            _stop(proc)
        self.procs = []
        if self.redis is not None:
            self.redis.close()
            self.redis = None
