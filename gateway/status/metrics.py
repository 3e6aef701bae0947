"""Prometheus metrics of the gateway (one registry per gateway instance, no globals).

The endpoint (:meth:`GatewayMetrics.serve`) answers only a scrape that sends the admin token as
``Authorization: Bearer <token>`` (as the admin API checks it): 401 otherwise, since the series name
every client's batches. The per-batch series (``batch`` label) cover the unfinished batches only, at most
``max_batches`` of them (``--metrics-batches``, :data:`METRICS_BATCHES`): those at risk first, then the
earliest predicted finish; a finished batch's series go at the next refresh, so the label's values are
bounded however many batches come and go.
"""

from __future__ import annotations

import hmac
import socket
import threading
from collections.abc import Mapping, Sequence
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from gateway.assign.policies import ClusterView, expected_finish_s
from gateway.status.cost import CostMeter
from gateway.status.eta import Eta
from predictor.calibration import Calibration
from workqueue import ClusterInfo

#: the most batches with series of their own (``batch`` label) at once, by default
METRICS_BATCHES = 100


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass


def bearer_only(app, token: str):
    """``app`` (WSGI) behind ``Authorization: Bearer <token>``: 401 without it (compared in constant time)."""
    expected = f"Bearer {token}".encode()

    def guarded(environ, start_response):
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if hmac.compare_digest(given, expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"missing or wrong token: send 'Authorization: Bearer <admin token>'\n"]

    return guarded


class GatewayMetrics:
    def __init__(self, max_batches: int = METRICS_BATCHES) -> None:
        if max_batches < 0:
            raise ValueError(f"max_batches must be >= 0, got {max_batches}")
        self.max_batches = max_batches
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
        self.batch_cost = Gauge(
            "fleetbatch_batch_cost_dollars",
            "Dollars billed to an unfinished batch so far (the billing model: gateway.status.cost)",
            ["batch"],
            registry=r,
        )
        self.cost_rate = Gauge(
            "fleetbatch_fleet_cost_dollars_per_hour",
            "What the fleet costs now: the prices of the clusters that hold work",
            registry=r,
        )
        self.cost_spent = Gauge(
            "fleetbatch_fleet_cost_dollars",
            "Dollars the fleet has cost since the gateway started",
            registry=r,
        )
        self.price = Gauge(
            "fleetbatch_cluster_price_dollars_per_hour",
            "A cluster's price, US dollars per hour (billed while it holds work)",
            labels,
            registry=r,
        )
        self.cluster_cost = Gauge(
            "fleetbatch_cluster_cost_dollars",
            "Dollars a cluster has cost since the gateway started",
            labels,
            registry=r,
        )
        self.calibration_ratio = Gauge(
            "fleetbatch_length_calibration_ratio",
            "Observed over predicted answer tokens of the served models, shrunk toward 1 (1: not calibrated)",
            registry=r,
        )
        self.calibration_observations = Gauge(
            "fleetbatch_length_calibration_observations",
            "Answers the length calibration of the served models was learned from",
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

    def observe_calibration(self, calibration: Calibration) -> None:
        self.calibration_ratio.set(calibration.ratio)
        self.calibration_observations.set(calibration.observations)

    def observe_etas(self, etas: Mapping[str, Eta], now: float) -> None:
        """The ETA and token progress of at most ``max_batches`` unfinished batches, those at risk first,
        then the earliest finish (the others', and finished batches', series are dropped)."""
        self.eta.clear()
        self.token_progress.clear()
        self.batch_cost.clear()
        shown = sorted(etas.items(), key=lambda kv: (not kv[1].at_risk, kv[1].finish_at, kv[0]))
        for batch_id, e in shown[: self.max_batches]:
            self.eta.labels(batch_id).set(max(0.0, e.finish_at - now))
            self.token_progress.labels(batch_id).set(e.progress)
            self.batch_cost.labels(batch_id).set(e.cost_dollars)
        self.at_risk.set(sum(1 for e in etas.values() if e.at_risk))

    def observe_cost(self, meter: CostMeter, clusters: Sequence[str]) -> None:
        """The fleet's cost rate and cost so far, and each cluster's price and cost so far (:mod:`gateway.status.cost`)."""
        self.cost_rate.set(meter.rate_per_hour())
        self.cost_spent.set(meter.spent)
        for name in clusters:
            c = meter.cluster(name)
            self.price.labels(name).set(c.price_per_hour or 0.0)
            self.cluster_cost.labels(name).set(c.dollars)

    def serve(self, port: int, addr: str = "127.0.0.1", token: str = "") -> WSGIServer:
        """Serve ``/metrics`` on ``addr:port`` (0: a free port; the server's ``server_port``) in a daemon
        thread, to scrapes that send ``token`` (the admin token) as a Bearer token; no token: refused."""
        if not token:
            raise ValueError(
                "the metrics endpoint needs the admin token ($FLEETBATCH_ADMIN_TOKEN or --admin-token): "
                "Prometheus sends it as 'Authorization: Bearer <token>'"
            )
        host = addr.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("MetricsServer", (_Server,), {"address_family": family})
        server = make_server(
            host, port, bearer_only(make_wsgi_app(self.registry), token), server_class, _Quiet
        )
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        return server
