"""The endpoint backend's settings: ``fleetbatch engine serve --backend endpoint``'s flags
(:func:`add_endpoint_arguments`), read and checked (:meth:`EndpointSettings.from_args`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from clusterfile import endpoint_base
from engines.endpoint_flow import FlowSettings
from engines.vllm_args import given
from workqueue.openai_body import PASS_THROUGH

#: the endpoints' API key, when no key file is named
API_KEY_ENV = "FLEETBATCH_ENDPOINT_API_KEY"


@dataclass(frozen=True)
class EndpointSettings:
    urls: tuple[str, ...]  # OpenAI base URLs (clusterfile.endpoint_base)
    model: str | None = None  # the model's name at the endpoints (None: what their /v1/models lists)
    api_key: str | None = None
    timeout_s: float = 60.0  # connecting, and the longest silence of a stream
    give_up_s: float = 300.0  # no endpoint answered this long while queries waited: the engine fails
    tokenizer_dir: str | None = None  # the served model's tokenizer, to continue chat rows
    flow: FlowSettings = field(default_factory=FlowSettings)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError(
                "the endpoint backend needs --endpoint-url URL (repeatable): the OpenAI-compatible "
                "servers to send queries to"
            )
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"an endpoint is named twice: {', '.join(self.urls)}")
        if not self.timeout_s > 0 or not self.give_up_s > 0:
            raise ValueError("the endpoint timeout and give-up time must be > 0")

    @classmethod
    def from_args(cls, args) -> EndpointSettings:
        """The settings of ``fleetbatch engine serve --backend endpoint``; a ValueError says what is wrong."""
        if args.served_model:
            raise ValueError(
                "the endpoint backend loads no model: name the one its endpoints serve with "
                "--served-model-name (default: the one their /v1/models lists)"
            )
        return cls(
            urls=tuple(endpoint_base(u) for u in args.endpoint_url or ()),
            model=args.served_model_name or None,
            api_key=api_key(args.endpoint_key_file),
            timeout_s=args.endpoint_timeout_s,
            give_up_s=args.endpoint_give_up_s,
            tokenizer_dir=getattr(args, "endpoint_tokenizer", None),
            flow=flow_settings(given(args.max_running)),
        )


def flow_settings(max_running: int | None) -> FlowSettings:
    """The flow control of ``engine serve``: the limit climbs from 4 in flight by itself, up to ``--max-running``
    only where that is given (its default is the native engine's batch, not a server's)."""
    if max_running is None:
        return FlowSettings()
    return FlowSettings(initial_limit=min(FlowSettings.initial_limit, max_running), max_limit=max_running)


def api_key(key_file: str | None) -> str | None:
    """The endpoints' API key: the first line of ``key_file``, else ``$FLEETBATCH_ENDPOINT_API_KEY``, else none."""
    if key_file:
        try:
            lines = Path(key_file).read_text().strip().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--endpoint-key-file {key_file}: cannot read it: {e}") from None
        if not lines or not lines[0].strip():
            raise ValueError(f"--endpoint-key-file {key_file} is empty")
        return lines[0].strip()
    return os.environ.get(API_KEY_ENV) or None


def add_endpoint_arguments(p: argparse.ArgumentParser) -> None:
    """The endpoint backend's options (``--backend endpoint``)."""
    g = p.add_argument_group(
        "the endpoint backend (--backend endpoint)",
        "Queries go to OpenAI-compatible inference servers already running (vLLM, TGI, SGLang, "
        "`transformers serve`...), streamed: chat rows to /v1/chat/completions as their messages, text rows "
        "to /v1/completions. Each server gets as many queries at once as give it its best completion "
        "tokens/s, found by climbing (at most --max-running where given), half as many after a 429/503 or "
        "a timeout; one overloaded, restarting or unreachable is asked again with exponential backoff and "
        "its queries are not failed; the cluster's capacity is the completion tokens/s measured.",
    )
    g.add_argument(
        "--endpoint-url",
        action="append",
        default=None,
        metavar="URL",
        help="a server's OpenAI base URL, http://HOST:PORT/v1 (/v1 is added when missing); repeat it for "
        "several servers, which share the queries, the least loaded first",
    )
    g.add_argument(
        "--endpoint-key-file",
        default=None,
        metavar="FILE",
        help=f"file whose first line is the servers' API key, sent as 'Authorization: Bearer KEY' "
        f"(default: ${API_KEY_ENV}; none)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model's name at the servers (default: the one their /v1/models lists)",
    )
    g.add_argument(
        "--endpoint-tokenizer",
        default=None,
        metavar="DIR",
        help="a local directory with the served model's tokenizer and chat template (no weights are read): a "
        "chat row resumed from a partial output (its cluster preempted or killed) is rendered with it and "
        "continued through /v1/completions; without it such a row runs again from the start (prompt rows "
        "need nothing)",
    )
    g.add_argument(
        "--endpoint-give-up-s",
        type=float,
        default=300.0,
        help="seconds no server may answer while queries wait before the engine stops and gives its "
        "queries back to the queue, for the gateway to move to other clusters (default 300)",
    )
    g.add_argument(
        "--endpoint-fields",
        default="all",
        metavar="LIST",
        help="the OpenAI request fields the servers honour, passed through from each row (comma-separated "
        f"from {', '.join(sorted(PASS_THROUGH))}; 'all' (default) or 'none'); the gateway refuses at "
        "submission a row carrying a field a cluster that could run it does not honour",
    )
    g.add_argument(
        "--endpoint-timeout-s",
        type=float,
        default=60.0,
        help="seconds to connect, and the longest silence of a stream, before a server counts as "
        "overloaded (the query is sent again, not failed)",
    )
