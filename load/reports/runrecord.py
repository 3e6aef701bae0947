"""What a run leaves behind for ``fleetbatch loadgen report``: results, a time series of what engines reported, metadata.

A run directory holds:

* ``results.jsonl`` -- one result per query (cluster, tokens, predicted tokens, timings);
* ``timeseries.jsonl`` -- per cluster, every ``interval_s``: the KV held during its engine's
  last step, the engine's cumulative KV token-seconds, queue length and running count, as
  the engines' heartbeats reported them, with the heartbeat's own time (:class:`Sampler`
  reads them from Redis), and the engine's cumulative device-busy seconds, steps and Redis
  round trips (None where the engine does not report them);
* ``meta.json`` -- what ran: batch id, policy, backend, fleet, workload.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from workqueue import WorkQueue, connect

RESULTS = "results.jsonl"
TIMESERIES = "timeseries.jsonl"
META = "meta.json"


class Sampler:
    """A thread that records each cluster's heartbeat figures every ``interval_s`` until stopped."""

    def __init__(self, redis_url: str, out_dir: Path, interval_s: float = 0.5):
        self.queue = WorkQueue(connect(redis_url))
        self.path = Path(out_dir) / TIMESERIES
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="run-sampler", daemon=True)

    def _run(self) -> None:
        with open(self.path, "a") as f:
            while not self._stop.is_set():
                t = time.time()
                try:
                    infos = self.queue.clusters()
                except Exception:  # noqa: BLE001 - a sample missed while Redis is away
                    infos = []
                for i in infos:
                    row = {
                        "t": round(t, 3),
                        "hb_t": i.last_heartbeat,  # when the engine sent these figures
                        "cluster": i.name,
                        "kv_step_tokens": i.kv_step_tokens,
                        "kv_token_seconds": i.kv_token_seconds,
                        "device_steps": i.device_steps,
                        "device_overrun_steps": i.device_overrun_steps,
                        "device_busy_s": i.device_busy_s,  # cumulative: seconds in steps (None: not reported)
                        "steps": i.steps,
                        "redis_round_trips": i.redis_round_trips,
                        "measured_tps": i.measured_tps,  # the engine's tokens/s over its recent steps
                        "queue_length": i.queue_length,
                        "running": i.running,
                        "alive": i.alive,
                    }
                    f.write(json.dumps(row) + "\n")
                f.flush()
                self._stop.wait(self.interval_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def write_run(out_dir: Path, results: Iterable[Mapping], meta: Mapping) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / RESULTS, "w") as f:
        for r in results:
            f.write(json.dumps(dict(r)) + "\n")
    (out_dir / META).write_text(json.dumps(dict(meta), indent=2))


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
