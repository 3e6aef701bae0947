"""The reference pages made from the schemas: the vocabulary, the cluster file, the config files.

Each function returns one page's Markdown; :data:`fleetbatch.reference.PAGES` lists them. The cluster file's
fields come from :mod:`clusterfile`'s pydantic models, the config files' keys from the model
:func:`cliutil.options_model` builds from each command's own parser, so the pages say what the code accepts.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

from cliutil import env_name, options_model
from clusterfile import (
    CLUSTER_FILE_VERSION,
    DEVICE_PRICES_PER_HOUR,
    SPOT_FRACTION,
    Cluster,
    ClusterFile,
    Emulation,
)
from fleetbatch.cli import part_parser
from fleetbatch.reference_markdown import code, header, table, text
from fleetbatch.vocabulary import RETIRED, SHORT, VOCABULARY

#: the commands that take ``--config-file``
CONFIG_COMMANDS = (("gateway", "serve"), ("engine", "serve"))

CLUSTER_EXAMPLE = f"""```yaml
version: {CLUSTER_FILE_VERSION}
clusters:
  - name: fast                     # planned and emulated by `fleetbatch gateway up`
    devices: [A100-40G, A100-40G]
  - name: aws-a100                 # engines you run, with a capacity hint and their plan
    capacity_tps: 3082
    backend: vllm
    plan: plans/aws-a100.json
emulation:                         # optional: how `gateway up` emulates devices on this CPU
  time_scale: 32
  reference: opt-30b
```"""


def _type(annotation: Any) -> str:
    shown = str(annotation).replace("typing.", "").replace("NoneType", "None")
    for noise in ("Annotated[", "<class '", "'>", "clusterfile.schema."):
        shown = shown.replace(noise, "")
    shown = shown.split(", FieldInfo")[0].split(", Strict")[0].split(", Ge")[0].split(", Gt")[0]
    return shown + "]" * (shown.count("[") - shown.count("]"))  # an Annotated inside Optional: its bracket


def _fields(model: type[BaseModel]) -> str:
    rows = []
    for name, f in model.model_fields.items():
        required = f.is_required()
        value = None if required else f.get_default(call_default_factory=True)
        default = "required" if required else "(below)" if isinstance(value, BaseModel) else repr(value)
        rows.append((code(name), code(_type(f.annotation)), text(default), text(f.description or "")))
    return table(("field", "type", "default", "meaning"), rows)


def vocabulary_page() -> str:
    out = header(
        "Vocabulary",
        "fleetbatch/vocabulary.py",
        "One flag per concept across every `fleetbatch` command: a flag means the same wherever it appears. "
        "A test walks the whole `--help` tree against this table and every command the docs show.",
    )
    out += table(
        ("flag", "meaning"), ((code(flag), text(meaning)) for flag, meaning in sorted(VOCABULARY.items()))
    )
    out += "\n## Short options\n\n"
    out += table(("short", "long"), ((code(s), code(long)) for s, long in sorted(SHORT.items())))
    out += "\n## Renamed flags\n\nThese names are gone; use the one on the right.\n\n"
    out += table(("old", "now"), ((code(old), text(new)) for old, new in sorted(RETIRED.items())))
    return out


def cluster_file_page() -> str:
    out = header(
        "Cluster file",
        "clusterfile/schema.py",
        "One file describes a fleet for every command that reads one: `fleetbatch gateway serve --clusters`, "
        "`fleetbatch gateway up --clusters` (which plans the clusters that name devices and starts the others "
        "as the file says) and `fleetbatch planner fleet`. YAML, or JSON by its suffix. A field the schema does "
        "not know is refused by name, as is a bad value.",
    )
    out += CLUSTER_EXAMPLE + "\n\n"
    out += f"## The file (version {CLUSTER_FILE_VERSION})\n\n" + _fields(ClusterFile)
    out += "\n## A cluster\n\n" + _fields(Cluster)
    out += "\n## Prices\n\n" + _prices()
    out += "\n## Emulation\n\n" + _fields(Emulation)
    return out


def _prices() -> str:
    """The price rule and the catalog's default prices (clusterfile.prices)."""
    out = (
        "A cluster's price, in US dollars per hour, is its `price_per_hour` when set (what the whole cluster costs "
        "in its market, taken as it is), else the sum of its devices' catalog prices below, times "
        f"{SPOT_FRACTION:g} on the `spot` market. A cluster with neither (no price, a device the table does not "
        "price, or no devices) has no known price: it is billed at nothing, and the cost policy takes it as free. "
        "The defaults are inputs, not claims: about GCP's published on-demand prices in us-central1; set "
        "`price_per_hour` to use your own. The billing model and `--policy cost`: "
        "[Spot GPUs and cost](../how-to/spot-and-cost.md).\n\n"
    )
    rows = sorted(DEVICE_PRICES_PER_HOUR.items(), key=lambda kv: (-kv[1], kv[0]))
    return out + table(
        ("device", "on demand, $/GPU-hour", "spot, $/GPU-hour"),
        ((code(d), f"{p:.2f}", f"{p * SPOT_FRACTION:.3f}") for d, p in rows),
    )


def _config_rows(parser: argparse.ArgumentParser) -> Iterable[tuple[str, ...]]:
    model = options_model(parser, "Options")
    flags = {a.dest: a for a in parser._actions if a.option_strings}
    for name, f in model.model_fields.items():
        a = flags[name]
        env = (
            code(env_name(name))
            if name != "client_tokens"
            else text("(none: the variable is the token table)")
        )
        meaning = f.description or ""
        if isinstance(a, argparse._StoreFalseAction):  # the key holds what the flag turns off
            meaning += f" (the key is the opposite of the flag: `{name}: false` is `{a.option_strings[-1]}`)"
        yield (
            code(name),
            code(a.option_strings[-1]),
            env,
            code(_type(f.annotation)),
            text(meaning),
        )


def config_file_page() -> str:
    out = header(
        "Config files",
        "each command's parser, through cliutil.config_file",
        "`fleetbatch gateway serve` and `fleetbatch engine serve` read every option from a YAML file "
        "(`--config-file FILE`, or `$FLEETBATCH_CONFIG_FILE`) and from `FLEETBATCH_<OPTION>` environment "
        "variables. Each option resolves from its flag first, then its variable, then the file, then its "
        "default. A key the command does not know, or a value of the wrong type, is refused by name.",
    )
    out += "```yaml\n# gateway.yaml: fleetbatch gateway serve --config-file gateway.yaml\n"
    out += "listen: 0.0.0.0:50051\nredis_url: redis://redis:6379/0\nclusters: clusters.yaml\nmetrics_port: 9100\n```\n"
    for part, command in CONFIG_COMMANDS:
        parser = next(
            sub
            for a in part_parser(part)._actions
            if isinstance(a, argparse._SubParsersAction)
            for name, sub in a.choices.items()
            if name == command
        )
        out += f"\n## `fleetbatch {part} {command}`\n\n"
        out += table(("key", "flag", "variable", "type", "meaning"), _config_rows(parser))
    return out
