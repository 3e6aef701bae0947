"""The cluster file's schema (version 1), its reading with errors that name the field, and its writing.

A cluster file::

    version: 1
    clusters:
      - name: fast
        devices: [A100-40G, A100-40G]   # catalog GPUs: `fleetbatch gateway up` plans and emulates them
      - name: aws-a100
        capacity_tps: 3082              # or a capacity hint, corrected by the engines' heartbeats
        backend: vllm
        plan: plans/aws-a100.json
      - name: ours
        backend: endpoint               # inference servers the user already runs (OpenAI-compatible)
        endpoints: [http://gpu-a:8000/v1, http://gpu-b:8000/v1]
        served_model: meta-llama/Llama-3.1-8B-Instruct
    emulation:                          # optional: how `gateway up` emulates devices on this CPU
      time_scale: 32
      reference: opt-30b

Unknown fields are refused by name, so a misspelt key never passes silently. A cluster's price
(``price_per_hour``, or its devices' catalog prices in its ``market``: :mod:`clusterfile.prices`) is
:meth:`Cluster.hourly_price`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from clusterfile.prices import Market, cluster_price_per_hour, market_name

CLUSTER_FILE_VERSION = 1
#: cluster names (and every other id that becomes part of a Redis key): 1-128 of these characters
NAME_PATTERN = r"[A-Za-z0-9_.\-]{1,128}"
BackendName = Literal["native", "static", "vllm", "endpoint"]
#: the backend that sends queries to the cluster's ``endpoints`` (servers it does not run itself)
ENDPOINT_BACKEND = "endpoint"

Count = Annotated[int, Field(ge=0, strict=True)]
Amount = Annotated[float, Field(ge=0, strict=True, allow_inf_nan=False)]


class ClusterFileError(ValueError):
    """A cluster file that cannot be read or does not fit the schema; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Emulation(_Strict):
    """How ``fleetbatch gateway up`` emulates the clusters' catalog devices on this machine."""

    time_scale: Annotated[float, Field(gt=0, strict=True, allow_inf_nan=False)] = Field(
        32.0, description="the fleet's fastest device takes this many times this CPU's time at 16 bits"
    )
    reference: str = Field(
        "opt-30b", description="the model whose catalog ratios and memory the devices keep"
    )


class Cluster(_Strict):
    """One cluster: its devices or a capacity, its backend and plan, and how its engine starts."""

    name: str = Field(pattern=f"^{NAME_PATTERN}$", description="unique; 1-128 of [A-Za-z0-9_.-]")
    devices: list[str] = Field(
        default_factory=list,
        description="catalog device types (e.g. [A100-40G, T4]); `gateway up` plans and emulates them",
    )
    capacity_tps: Amount = Field(
        0.0, description="capacity hint in tokens/s before heartbeats arrive (0: learn it from them)"
    )
    backend: BackendName = Field("native", description="the engine backend")
    plan: str | None = Field(None, description="plan.json written by `fleetbatch planner plan`")
    redis_url: str | None = Field(None, description="the shared Redis (kept for the k8s manifests)")
    max_query_tokens: Count = Field(0, description="longest query (prompt + response) it takes (0: any)")
    kv_budget_tokens: Count = Field(0, description="its KV cache in tokens (0: from its heartbeats)")
    engine_args: list[str] = Field(
        default_factory=list, description="extra `fleetbatch engine serve` flags (for `gateway up`)"
    )
    served_model: str | None = Field(
        None,
        description="the model this cluster serves: a local Hugging Face directory, or with the endpoint "
        "backend the model's name at its endpoints (default: the one their /v1/models lists)",
    )
    endpoints: list[str] = Field(
        default_factory=list,
        description="the endpoint backend's OpenAI-compatible inference servers, as base URLs "
        "(http://host:port/v1; /v1 is added when missing)",
    )
    price_per_hour: Amount | None = Field(
        None,
        description="what the whole cluster costs, US dollars per hour (default: its devices' catalog "
        "prices in its market; clusterfile.prices)",
    )
    market: Market = Field(
        "on-demand",
        description="on-demand or spot (cheaper, may be taken away); on_demand is read as on-demand",
    )

    @field_validator("market", mode="before")
    @classmethod
    def _market(cls, value: object) -> object:
        return market_name(value)

    @field_validator("devices", "engine_args", "endpoints")
    @classmethod
    def _no_empty(cls, value: list[str]) -> list[str]:
        if any(not item.strip() for item in value):
            raise ValueError("entries must not be empty")
        return value

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        return [endpoint_base(url) for url in value]

    @model_validator(mode="after")
    def _endpoints_need_their_backend(self) -> Cluster:
        if self.backend == ENDPOINT_BACKEND:
            if not self.endpoints:
                raise ValueError("the endpoint backend needs 'endpoints' (the servers' URLs)")
            if self.devices or self.plan:
                raise ValueError(
                    "the endpoint backend's servers are not planned: leave out 'devices' and 'plan'"
                )
        elif self.endpoints:
            raise ValueError(f"'endpoints' are for 'backend: {ENDPOINT_BACKEND}', not {self.backend}")
        return self

    def __init__(self, name: str | None = None, /, **fields: Any) -> None:
        """``Cluster("a", capacity_tps=100)``: the name may come first, unnamed."""
        super().__init__(**({"name": name} if name is not None else {}), **fields)

    def reserved_set(self) -> list[str]:
        """The reserved fields this cluster sets (accepted, not used yet): none are left (prices and markets are
        read by the cost policy and the status, gateway.assign.cost)."""
        return []

    def hourly_price(self) -> float | None:
        """What the cluster costs, US dollars per hour: its ``price_per_hour``, else its devices' catalog price in
        its market, else None (not known; :func:`clusterfile.prices.cluster_price_per_hour`)."""
        return cluster_price_per_hour(self.price_per_hour, self.devices, self.market)


class ClusterFile(_Strict):
    """The whole file: its version, its clusters, and how devices are emulated."""

    version: Literal[1] = Field(description="the schema's version (1)")
    clusters: list[Cluster] = Field(min_length=1, description="the clusters, each with a unique name")
    emulation: Emulation = Field(default_factory=Emulation, description="for clusters that name devices")

    @model_validator(mode="after")
    def _unique_names(self) -> ClusterFile:
        seen: set[str] = set()
        for c in self.clusters:
            if c.name in seen:
                raise ValueError(f"cluster name {c.name!r} appears twice")
            seen.add(c.name)
        return self

    @property
    def planned(self) -> bool:
        """Whether the clusters name devices (a fleet `gateway up` plans) rather than engines as given."""
        return any(c.devices for c in self.clusters)


def endpoint_base(url: str) -> str:
    """An inference server's OpenAI base URL, ``http(s)://host[:port][/path]/v1`` (``/v1`` added when the
    URL does not end with it; a trailing ``/`` dropped); a ValueError says what is wrong with ``url``."""
    text = url.strip()
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as e:
        raise ValueError(f"endpoint {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"endpoint {url!r}: expected http://HOST[:PORT][/PATH] or https://...")
    if parts.query or parts.fragment:
        raise ValueError(f"endpoint {url!r}: a base URL has no query or fragment")
    base = text.split("#", 1)[0].split("?", 1)[0].rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def _where(loc: tuple[Any, ...], data: object) -> str:
    """``clusters.1.capacity_tps`` as ``cluster 'fast': capacity_tps``."""
    if len(loc) >= 2 and loc[0] == "clusters" and isinstance(loc[1], int):
        rows = data.get("clusters") if isinstance(data, dict) else None
        row = rows[loc[1]] if isinstance(rows, list) and loc[1] < len(rows) else None
        name = row.get("name") if isinstance(row, dict) else None
        who = f"cluster {name!r}" if isinstance(name, str) else f"cluster #{loc[1] + 1}"
        return who + (": " + ".".join(map(str, loc[2:])) if loc[2:] else "")
    return ".".join(map(str, loc)) or "the file"


def _explain(e: ValidationError, data: object) -> str:
    lines = []
    for err in e.errors():
        msg = {
            "extra_forbidden": "unknown field",
            "string_pattern_mismatch": "must be 1-128 characters of [A-Za-z0-9_.-]",
        }.get(err["type"], err["msg"])
        if err["type"] == "missing" and err["loc"] == ("version",):
            msg = f"missing: add `version: {CLUSTER_FILE_VERSION}` (this is cluster file version {CLUSTER_FILE_VERSION})"
        lines.append(f"{_where(err['loc'], data)}: {msg}")
    return "; ".join(lines)


def parse_cluster_file(data: object, source: str = "cluster file") -> ClusterFile:
    """A :class:`ClusterFile` from parsed YAML/JSON, or a :class:`ClusterFileError` naming each bad field."""
    if not isinstance(data, dict):
        raise ClusterFileError(
            f"{source}: expected a mapping with 'version' and 'clusters', not {type(data).__name__}"
        )
    try:
        return ClusterFile.model_validate(data)
    except ValidationError as e:
        raise ClusterFileError(f"{source}: {_explain(e, data)}") from None


def load_cluster_file(path: str | Path) -> ClusterFile:
    """Read and validate a cluster file (YAML, or JSON by its suffix)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ClusterFileError(f"cluster file {p} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ClusterFileError(f"cluster file {p}: cannot read it: {e}") from None
    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ClusterFileError(
            f"{p}: not valid {'JSON' if p.suffix.lower() == '.json' else 'YAML'}: {e}"
        ) from None
    return parse_cluster_file(data, str(p))


def dump_cluster_file(
    path: str | Path, clusters: list[Cluster] | list[dict], emulation: Emulation | None = None
) -> ClusterFile:
    """Validate and write a cluster file (YAML); only fields that differ from their defaults are written."""
    rows = [c if isinstance(c, Cluster) else Cluster.model_validate(c) for c in clusters]
    doc = ClusterFile(version=CLUSTER_FILE_VERSION, clusters=rows, emulation=emulation or Emulation())
    data = doc.model_dump(exclude_defaults=True)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
    return doc
