"""Prometheus metrics of the gateway (one registry per gateway instance, no globals)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from gateway.assign.policies import ClusterView, expected_finish_s
from gateway.status.eta import Eta
from workqueue import ClusterInfo


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.batches = Counter("fleetbatch_batches_submitted", "Batches accepted", registry=r)
        self.rejected = Counter("fleetbatch_batches_rejected", "Batches rejected as invalid", registry=r)
        self.queries = Counter("fleetbatch_queries_assigned", "Queries assigned", ["cluster"], registry=r)
        self.assign_seconds = Histogram(
            "fleetbatch_assign_seconds", "Time to predict lengths and assign one batch", registry=r
        )
        self.moves = Counter(
            "fleetbatch_queries_moved", "Queries moved by offloading/rebalance", ["src", "dst"], registry=r
        )
        labels = ["cluster"]
        self.queue_depth = Gauge("fleetbatch_queue_depth", "Queued queries", labels, registry=r)
        self.pending_tokens = Gauge(
            "fleetbatch_pending_predicted_tokens", "Predicted tokens of held work", labels, registry=r
        )
        self.capacity = Gauge("fleetbatch_capacity_tokens_per_s", "Effective capacity", labels, registry=r)
        self.finish = Gauge(
            "fleetbatch_expected_finish_seconds", "Expected finish time of held work", labels, registry=r
        )
        self.assigned_pred = Gauge(
            "fleetbatch_assigned_predicted_tokens",
            "Predicted tokens assigned (net of moves)",
            labels,
            registry=r,
        )
        self.finished_pred = Gauge(
            "fleetbatch_finished_predicted_tokens", "Predicted tokens of finished queries", labels, registry=r
        )
        self.finished_actual = Gauge(
            "fleetbatch_finished_actual_tokens", "Generated tokens of finished queries", labels, registry=r
        )
        self.alive = Gauge("fleetbatch_cluster_alive", "1 while heartbeats arrive", labels, registry=r)
        self.eta = Gauge(
            "fleetbatch_batch_eta_seconds",
            "Seconds until an unfinished batch's predicted finish",
            ["batch"],
            registry=r,
        )
        self.token_progress = Gauge(
            "fleetbatch_batch_token_progress",
            "Predicted tokens of a batch's answered rows over its predicted tokens",
            ["batch"],
            registry=r,
        )
        self.at_risk = Gauge(
            "fleetbatch_batches_at_risk",
            "Unfinished batches predicted to finish past their deadline",
            registry=r,
        )
        self.finalize_failures = Counter(
            "fleetbatch_finalize_failed_passes",
            "Passes that could not write a batch's output files",
            registry=r,
        )
        self.finalize_retrying = Gauge(
            "fleetbatch_finalize_retrying_batches", "Batches waiting to retry writing their files", registry=r
        )
        self.finalize_gave_up = Counter(
            "fleetbatch_finalize_gave_up",
            "Batches failed: their retention ended before the files",
            registry=r,
        )

    def observe_clusters(self, infos: Sequence[ClusterInfo], views: Sequence[ClusterView]) -> None:
        for info, view in zip(infos, views, strict=True):
            n = info.name
            self.queue_depth.labels(n).set(info.queue_length)
            self.pending_tokens.labels(n).set(view.pending_tokens)
            self.capacity.labels(n).set(view.capacity_tps)
            self.finish.labels(n).set(expected_finish_s(view))
            self.assigned_pred.labels(n).set(info.assigned_predicted_tokens)
            self.finished_pred.labels(n).set(info.finished_predicted_tokens)
            self.finished_actual.labels(n).set(info.finished_actual_tokens)
            self.alive.labels(n).set(1 if info.alive else 0)

    def observe_etas(self, etas: Mapping[str, Eta], now: float) -> None:
        """Each unfinished batch's ETA and token progress (finished batches' series are dropped)."""
        self.eta.clear()
        self.token_progress.clear()
        for batch_id, e in etas.items():
            self.eta.labels(batch_id).set(max(0.0, e.finish_at - now))
            self.token_progress.labels(batch_id).set(e.progress)
        self.at_risk.set(sum(1 for e in etas.values() if e.at_risk))

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
