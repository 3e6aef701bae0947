"""Prometheus metrics of an engine's pipeline stages and of its worker, read at every scrape.

Per stage (label ``stage``, plus its layer range and device): micro-batches, compute seconds
(CPU time of the stage's thread on CPU), emulated seconds (the sleep of a slower device), idle
seconds (waiting for the previous stage or for results), memory (weights + KV pools), and the
mean measured decode micro-batch latency beside the plan's predicted one. Under ``fleetbatch engine serve
--device-cost plan``, also the device's modelled seconds and the micro-batches (and seconds) by
which the real compute outlasted it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_COUNTERS = {
    "micro_batches": ("fleetbatch_stage_micro_batches", "micro-batches a stage computed"),
    "compute_s": ("fleetbatch_stage_compute_seconds", "compute time of a stage"),
    "sleep_s": ("fleetbatch_stage_emulated_seconds", "extra time slept to emulate a slower device"),
    "idle_s": ("fleetbatch_stage_idle_seconds", "time a stage waited for work (pipeline bubbles)"),
    "device_s": (
        "fleetbatch_stage_device_seconds",
        "modelled seconds of a stage's device (--device-cost plan: its cost model's charge)",
    ),
    "device_steps": (
        "fleetbatch_stage_device_micro_batches",
        "micro-batches a stage's device cost model charged (--device-cost plan)",
    ),
    "device_overrun_steps": (
        "fleetbatch_stage_device_overrun_micro_batches",
        "micro-batches whose compute outlasted the stage's device cost model",
    ),
    "device_overrun_s": (
        "fleetbatch_stage_device_overrun_seconds",
        "seconds by which compute outlasted the stage's device cost model",
    ),
}


class StageCollector:
    """Collects per-stage figures from ``engine.pipeline`` (nothing for a one-process engine)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        pipeline = getattr(self.engine, "pipeline", None)
        if pipeline is None:
            return
        rows = pipeline.stage_counters()
        labels = ["stage", "layers", "device"]

        def values(s):
            return [str(s.index), f"{s.layer_start}-{s.layer_end}", s.device_name or "local"]

        for key, (name, doc) in _COUNTERS.items():
            m = CounterMetricFamily(name, doc, labels=labels)
            for s, row in zip(pipeline.stages, rows, strict=True):
                m.add_metric(values(s), row[key])
            yield m
        mem = GaugeMetricFamily(
            "fleetbatch_stage_memory_bytes", "weights + KV pools of a stage", labels=labels
        )
        lat = GaugeMetricFamily(
            "fleetbatch_stage_decode_latency_seconds",
            "mean measured latency of a decode micro-batch in a stage (compute + emulated)",
            labels=labels,
        )
        pred = GaugeMetricFamily(
            "fleetbatch_stage_predicted_decode_latency_seconds",
            "the plan's predicted latency of a decode micro-batch in a stage",
            labels=labels,
        )
        for s, row in zip(pipeline.stages, rows, strict=True):
            mem.add_metric(values(s), row["memory_bytes"])
            n = row["decode_micro_batches"]
            lat.add_metric(values(s), row["decode_latency_s"] / n if n else 0.0)
            pred.add_metric(values(s), s.predicted_decode_s)
        yield from (mem, lat, pred)


class WorkerCollector:
    """The step loop's and the queue agent's figures: steps, busy time, round trips, ticks, claims ahead."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def collect(self):
        w, a = self.worker, self.worker.agent
        for name, doc, value in (
            ("fleetbatch_worker_steps", "engine steps", w.steps),
            (
                "fleetbatch_worker_busy_seconds",
                "wall time in engine steps (the emulated device's included)",
                w.busy_s,
            ),
            (
                "fleetbatch_worker_redis_round_trips",
                "round trips of the worker's queue client to Redis",
                w.round_trips.value,
            ),
            ("fleetbatch_worker_ticks", "queue agent ticks (each one round trip)", a.ticks),
            ("fleetbatch_worker_results_written", "results the queue agent wrote", a.finished),
            (
                "fleetbatch_worker_prefix_lookup_tokens",
                "tokens of admitted queries that needed KV (the prefix cache looked them up)",
                w.engine_stats.prefix_lookup_tokens,
            ),
            (
                "fleetbatch_worker_prefix_hit_tokens",
                "tokens found in the prefix cache: prefill saved",
                w.engine_stats.prefix_hit_tokens,
            ),
            (
                "fleetbatch_worker_resumed_queries",
                "queries started from the partial output of a run preempted or killed elsewhere",
                w.resumed_queries,
            ),
            (
                "fleetbatch_worker_resumed_tokens",
                "tokens of those partial outputs: generated once, not again",
                w.resumed_tokens,
            ),
        ):
            m = CounterMetricFamily(name, doc)
            m.add_metric([], value)
            yield m
        for name, doc, value in (
            ("fleetbatch_worker_tick_seconds", "a queue agent tick's duration (moving average)", a.tick_s),
            (
                "fleetbatch_worker_claimed_ahead",
                "claimed queries waiting for room in the engine",
                len(a.inbox),
            ),
            (
                "fleetbatch_worker_unwritten_results",
                "finished queries whose result is not written yet",
                a.unwritten(),
            ),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g


def serve_metrics(engine, port: int, addr: str = "0.0.0.0", worker=None) -> CollectorRegistry:
    """Serve the stage metrics of ``engine`` (and ``worker``'s) on ``port`` (a registry of its own,
    no global state)."""
    registry = CollectorRegistry()
    registry.register(StageCollector(engine))
    if worker is not None:
        registry.register(WorkerCollector(worker))
    start_http_server(port, addr=addr, registry=registry)
    return registry
