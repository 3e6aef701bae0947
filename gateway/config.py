"""Gateway settings, and the clusters of a cluster file (:mod:`clusterfile`)."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from clusterfile import NAME_PATTERN, Cluster, load_cluster_file
from workqueue.embedded import redact_url  # noqa: F401 - re-exported: the gateway logs URLs through it

log = logging.getLogger(__name__)

TOKEN_ENV = "FLEETBATCH_ADMIN_TOKEN"
HTTP_KEY_ENV = "FLEETBATCH_HTTP_API_KEY"  # the OpenAI-compatible HTTP front's Bearer key
#: positions of the project's default serving model (``localmodels.build_model``'s default)
DEFAULT_MAX_POSITIONS = 2048
#: default bound, in seconds, on how long background intake waits for a cluster that can take a query
INTAKE_WAIT_S = 300.0
#: cluster names (and every other id that becomes part of a Redis key)
NAME_RE = re.compile(NAME_PATTERN + r"\Z")  # \Z: "$" would accept a trailing newline


#: one cluster as configured (the cluster file's schema): what the gateway may assume before heartbeats arrive
ClusterSpec = Cluster


@dataclass
class GatewayConfig:
    redis_url: str | None = None
    listen: str = "127.0.0.1:50051"
    admin_token: str = ""
    policy: str = "token"
    spot_margin: float | None = None  # the cost policy's spot margin (None: its default, gateway.assign.cost)
    predictor_dir: str | None = None
    predictor_threads: int = 1  # torch threads for length prediction (more threads slowed it on busy hosts)
    tokenizer_dir: str | None = None  # serving model directory whose tokenizer counts prompt tokens
    chat_template: str = ""  # "default": chat rows without a served model take the documented template
    max_prompt_tokens: int = 2048
    default_max_tokens: int = 256
    max_max_tokens: int = 4096
    max_batch_queries: int = 1_000_000
    max_prompt_bytes: int = 256 * 1024  # checked before tokenizing
    max_metadata_bytes: int = 16 * 1024  # per metadata map (keys + values, UTF-8)
    max_request_bytes: int = 256 * 1024 * 1024  # gRPC receive limit: larger is RESOURCE_EXHAUSTED
    max_inflight_bytes: int = 512 * 1024 * 1024  # requests being decoded and handled at once, in bytes
    max_concurrent_rpcs: int = 1000  # calls (streams included) served at once; more: RESOURCE_EXHAUSTED
    client_tokens: dict[str, str] = field(default_factory=dict)  # token -> client id; empty: no auth
    max_positions: int = 0  # the model's positions (start token counted); 0: from the tokenizer dir
    on_bad_query: str = "reject"  # reject | fail-row: what a bad query does when the request leaves it open
    tls_cert: str | None = None  # PEM certificate chain: serve gRPC over TLS (with tls_key)
    tls_key: str | None = None
    max_queued_per_client: int = 0  # queries a client may have queued or running at once (0: no cap)
    retention_s: float = 7 * 24 * 3600  # finished batches expire from Redis after this long (0: never)
    offload: bool = True
    offload_interval_s: float = 0.5
    queue_order: str = "edf"  # edf | fifo: how batches are ordered in every queue (workqueue.ordering)
    priority_step_s: float = 3600.0
    intake_wait_s: float = INTAKE_WAIT_S  # intake waits this long for a cluster that can take a query
    shared_prefix_cache: bool = False  # no per-tenant salt in the engines' prefix-cache keys
    metrics_port: int = 0  # 0: no Prometheus endpoint
    metrics_host: str = "127.0.0.1"  # the Prometheus endpoint's address (0.0.0.0 in a pod)
    metrics_batches: int = 100  # most unfinished batches with series of their own (gateway.status.metrics)
    clusters: list[ClusterSpec] = field(default_factory=list)
    bound_address: str = ""  # set by the server once it listens (port 0 picks a free one)
    http_port: int | None = None  # the OpenAI-compatible HTTP front (0: any free port; None: off)
    http_api_key: str = ""  # its Bearer key
    files_dir: str = ""  # where it keeps /v1/files: a directory, or s3://bucket/prefix (object storage)
    http_url: str = ""  # set once the HTTP front listens: http://host:port/v1

    @classmethod
    def from_args(
        cls,
        args,
        *,
        redis_url: str,
        admin_token: str,
        clusters: list[ClusterSpec],
        client_tokens: dict[str, str] | None = None,
    ) -> GatewayConfig:
        """The config of ``fleetbatch gateway serve`` / ``fleetbatch gateway up`` from their shared command-line options."""
        port = getattr(args, "http_port", None)
        return cls(
            redis_url=redis_url,
            listen=args.listen,
            admin_token=admin_token,
            policy=args.policy,
            spot_margin=getattr(args, "spot_margin", None),
            predictor_dir=args.predictor or "shipped",  # the learned model shipped with us; 'heuristic' too
            predictor_threads=args.predictor_threads,
            tokenizer_dir=args.served_model,
            chat_template=getattr(args, "chat_template", None) or "",
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            metrics_batches=getattr(args, "metrics_batches", 100),
            offload=not args.no_offload,
            queue_order=args.queue_order,
            priority_step_s=args.priority_step_s,
            max_prompt_tokens=args.max_prompt_tokens,
            max_prompt_bytes=args.max_prompt_bytes,
            max_request_bytes=int(args.max_request_mb * 1024 * 1024),
            max_inflight_bytes=int(args.max_inflight_mb * 1024 * 1024),
            max_concurrent_rpcs=args.max_concurrent_rpcs,
            client_tokens=dict(client_tokens or {}),
            max_positions=args.max_positions,
            on_bad_query=args.on_bad_query,
            max_queued_per_client=args.max_queued_per_client,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            retention_s=args.retention_hours * 3600,
            intake_wait_s=args.intake_wait_s,
            shared_prefix_cache=getattr(args, "shared_prefix_cache", False),
            clusters=clusters,
            http_port=None
            if port is None or port < 0
            else port,  # negative: no HTTP front (serve and up alike)
            http_api_key=getattr(args, "http_api_key", None) or os.environ.get(HTTP_KEY_ENV, ""),
            files_dir=getattr(args, "files", None) or "",  # --files
        )

    def token(self) -> str:
        return self.admin_token or os.environ.get(TOKEN_ENV, "")

    def model_positions(self) -> int:
        """The serving model's positions: ``max_positions``, else the tokenizer dir's config, else the default."""
        if self.max_positions > 0:
            return self.max_positions
        if self.tokenizer_dir:
            try:
                cfg = json.loads((Path(self.tokenizer_dir) / "config.json").read_text())
            except (OSError, ValueError):
                cfg = {}
            for key in ("max_position_embeddings", "n_positions"):
                if isinstance(cfg.get(key), int) and cfg[key] > 0:
                    return cfg[key]
        return DEFAULT_MAX_POSITIONS


def load_clusters(path: str | os.PathLike) -> list[ClusterSpec]:
    """The clusters of a cluster file (:mod:`clusterfile`); the reserved fields it sets are logged as not used yet."""
    doc = load_cluster_file(path)
    for c in doc.clusters:
        if c.reserved_set():
            log.warning(
                "%s: cluster %s sets %s, which this version does not use yet", path, c.name, c.reserved_set()
            )
    return list(doc.clusters)
