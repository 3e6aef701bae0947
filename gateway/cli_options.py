"""The options ``fleetbatch gateway serve`` and ``fleetbatch gateway up`` share: the HTTP front, and the gateway's
policy, predictor, limits, intake and offloading settings (parsed into :class:`GatewayConfig`); and those of
``fleetbatch gateway rebalance``."""

from __future__ import annotations

import argparse

from gateway.assign.cost import MARGIN, SPOT_MARGIN, check_margins
from gateway.assign.registry import POLICIES
from gateway.config import HTTP_KEY_ENV, INTAKE_WAIT_S, TOKEN_ENV


def add_http(s: argparse.ArgumentParser, port: int | None, shown: str, files_dir: str | None) -> None:
    s.add_argument(
        "--http-port",
        type=int,
        default=port,
        help=f"serve the OpenAI-compatible /v1/files and /v1/batches on this port (0: any free port; "
        f"negative: no HTTP front; default: {shown})",
    )
    s.add_argument(
        "--http-api-key", default=None, help=f"Bearer key of the HTTP front (default: ${HTTP_KEY_ENV})"
    )
    s.add_argument(
        "--files",
        default=files_dir,
        help="where the HTTP front keeps its files: a directory, or s3://BUCKET/PREFIX for S3-compatible "
        "object storage (endpoint, region and credentials as the AWS SDK reads them: AWS_ENDPOINT_URL, "
        f"AWS_REGION, AWS_ACCESS_KEY_ID, ...; default: {files_dir or 'RUN_DIR/files'})",
    )


class _SpotMargin(argparse.Action):
    """``--spot-margin``: a share in (0, 1] (:func:`gateway.assign.cost.check_margins`; a config file's value is
    checked when the policy is made)."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        try:
            check_margins(MARGIN, value)
        except ValueError as e:
            parser.error(f"argument {option_string}: {e}")
        setattr(namespace, self.dest, value)


def add_common(s: argparse.ArgumentParser) -> None:
    s.add_argument("--policy", default="token", choices=sorted(POLICIES), help="assignment policy")
    s.add_argument(
        "--spot-margin",
        type=float,
        action=_SpotMargin,
        default=None,
        metavar="SHARE",
        help="with --policy cost: a spot cluster's share of a batch is done within this share of its window, the "
        f"rest being room for a preemption (default {SPOT_MARGIN}; at most the on-demand clusters' {MARGIN}; "
        "larger saves more where spot clusters are seldom preempted)",
    )
    s.add_argument(
        "--predictor",
        default=None,
        help="length predictor: a model directory, 'shipped' (the default: the learned model shipped "
        "with fleetbatch) or 'heuristic' (prompt-length heuristic)",
    )
    s.add_argument(
        "--served-model",
        metavar="DIR",
        default=None,
        help="the served model's directory (Hugging Face): its tokenizer counts prompt tokens (and with "
        "`gateway up --num-clusters`, the engines load it)",
    )
    s.add_argument(
        "--chat-template",
        choices=["default"],
        default=None,
        help="'default': chat rows are rendered with the documented <|role|> headers where no served model "
        "gives its own template (the project's own random models; `gateway up` asks for it when it runs "
        "them); without it or --served-model, chat rows are refused",
    )
    s.add_argument("--predictor-threads", type=int, default=1, help="torch threads for length prediction")
    s.add_argument("--admin-token", default=None, help=f"admin API token (default: ${TOKEN_ENV})")
    s.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)"
    )
    s.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address of the metrics endpoint (default: loopback; 0.0.0.0 to be scraped from outside)",
    )
    s.add_argument(
        "--metrics-batches",
        type=int,
        default=100,
        metavar="N",
        help="most unfinished batches with metrics series of their own (at risk first, then the earliest "
        "finish); finished batches have none",
    )
    s.add_argument(
        "--no-offload",
        action="store_true",
        help="no offloading between live clusters (lease recovery and evacuation still run)",
    )
    s.add_argument(
        "--queue-order",
        choices=("edf", "fifo"),
        default="edf",
        help="order of work across batches in every queue: earliest deadline first (default) or first in, "
        "first out (docs/design/deadlines.md)",
    )
    s.add_argument(
        "--priority-step-s",
        type=float,
        default=3600.0,
        help="a batch's priority moves it ahead as if its deadline were this many seconds earlier per level",
    )
    s.add_argument("--max-prompt-tokens", type=int, default=2048, help="longest prompt accepted")
    s.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=256 * 1024,
        help="longest prompt in UTF-8 bytes, checked before tokenizing",
    )
    s.add_argument(
        "--max-request-mb",
        type=float,
        default=256.0,
        help="gRPC receive limit in MiB: larger requests are RESOURCE_EXHAUSTED",
    )
    s.add_argument(
        "--max-inflight-mb",
        type=float,
        default=512.0,
        help="requests decoded and handled at once, in MiB; a request past it is RESOURCE_EXHAUSTED (retry)",
    )
    s.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=1000,
        help="calls served at once, result streams included; more are RESOURCE_EXHAUSTED",
    )
    s.add_argument(
        "--max-positions",
        type=int,
        default=0,
        help="the model's positions (start token counted; 0: from --served-model's config, else 2048)",
    )
    s.add_argument(
        "--on-bad-query",
        choices=("reject", "fail-row"),
        default="reject",
        help="a bad query rejects its batch, or fails alone (when the request does not choose)",
    )
    s.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve gRPC over TLS")
    s.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    s.add_argument(
        "--max-queued-per-client",
        type=int,
        default=0,
        help="queries one client (its token's, else its x-client-id header, else its address) may have unfinished (0: no cap)",
    )
    s.add_argument(
        "--retention-hours",
        type=float,
        default=168.0,
        help="keep a finished batch's status and results this long, then Redis drops them (0: forever)",
    )
    s.add_argument(
        "--intake-wait-s",
        type=float,
        default=INTAKE_WAIT_S,
        help="how long background intake waits for a cluster that can take a query (one restarting or "
        "loading its model) before it fails the query",
    )
    s.add_argument(
        "--shared-prefix-cache",
        action="store_true",
        help="one prefix cache for every client: no per-tenant salt in the engines' prefix-cache keys "
        "(by default each batch owner's rows hit only their own cached prefixes)",
    )


def add_rebalance(p: argparse.ArgumentParser, target: str) -> None:
    """The options of ``fleetbatch gateway rebalance`` (``target``: the default gateway address)."""
    p.add_argument("--target", default=target, help="gateway address host:port")
    p.add_argument("--token", default=None, help=f"admin token (default: ${TOKEN_ENV} or --token-file)")
    p.add_argument(
        "--token-file",
        default=None,
        help="file holding the admin token (fleetbatch gateway up: runs/local/admin-token)",
    )
    p.add_argument("--apply", action="store_true", help="carry out the moves (default: dry run)")
    p.add_argument(
        "--drain",
        metavar="CLUSTER",
        action="append",
        help="stop assigning to CLUSTER and move its queue away",
    )
    p.add_argument(
        "--add", metavar="CLUSTER", help="register a new cluster (its engine may start later; needs --apply)"
    )
    p.add_argument(
        "--capacity", type=float, default=0.0, help="with --add: capacity hint in tokens/s (finite, >= 0)"
    )
    p.add_argument("--update", action="store_true", help="with --add: change an existing cluster")
    p.add_argument("--remove", metavar="CLUSTER", help="drain and remove CLUSTER")
    p.add_argument(
        "--preempt",
        metavar="CLUSTER",
        help="give CLUSTER a preemption notice: it claims nothing more, finishes the queries that end within "
        "--notice, checkpoints and gives back the others (no attempt used), and its queue moves away",
    )
    p.add_argument(
        "--notice", type=float, default=0.0, help="seconds of the preemption notice (--preempt; default 0)"
    )
    p.add_argument("--force", action="store_true", help="with --remove: even while it still runs queries")
    p.add_argument("--json", action="store_true", help="print the response as JSON")
    p.add_argument("--tls-ca", default=None, help="CA certificate (PEM): connect over TLS")
