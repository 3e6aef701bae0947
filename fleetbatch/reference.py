"""The generated pages of the docs site's reference (``docs/reference/``), made from the code itself.

:data:`PAGES` maps each page (its path under ``docs/``) to the function that writes it: adding a page is one
entry. ``python -m fleetbatch.reference`` writes them; ``--check`` exits 1 naming the stale ones. Sources: the
argparse tree (built with no ``FLEETBATCH_*`` variable set; a default that is an absolute path or follows the
CPU count reads "(depends on the machine)"), the ``protos`` descriptors with ``fleetbatch.proto``'s comments,
the gateway's metrics registry and the engine's collectors, the HTTP front's Starlette app (no server runs).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import os
import re
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

from fleetbatch import reference_schemas
from fleetbatch.cli import PARTS, part_parser, top_parser
from fleetbatch.reference_markdown import code, header, link, table, text

DOCS = Path(__file__).resolve().parent.parent / "docs"
MACHINE = "(depends on the machine)"
CLI_INTRO = (
    "One command, `fleetbatch`; each part of the project is a subcommand with commands of its own. Every "
    "command also answers `--help`. Exit status: 0 on success, 2 for a usage error, 1 for any other failure."
)
GRPC_INTRO = (
    "Package `{package}`, on the gateway's `--listen` address. `BatchService` calls need `authorization: Bearer "
    "<client token>` (unless the gateway runs `--no-auth`), `AdminService` calls the admin token. Errors are "
    "gRPC status codes whose message names the field, the query or the limit."
)
METRICS_INTRO = (
    "The gateway and each engine export Prometheus' text format over HTTP, each on a port of its own. A "
    "counter's name ends in `_total`; a histogram exports `_bucket`, `_sum` and `_count` series."
)
HTTP_INTRO = (
    "OpenAI's Batch API over the gateway's batches: `fleetbatch gateway up` serves it and prints its URL "
    "(`--http-port -1`: off), `fleetbatch gateway serve` with `--http-port PORT --http-api-key KEY`. Errors "
    'have OpenAI\'s body, `{"error": {"message", "type", "param", "code"}}`; no or a wrong key is a 401.'
)


# ---------------------------------------------------------------------------------------------- cli.md


def _parsers(cpus: int | None = None) -> dict[str, argparse.ArgumentParser]:
    """The top parser and every part's, built with no ``FLEETBATCH_*`` variable set; with ``cpus``, as on
    another machine: that many CPUs, and another home and working directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETBATCH_")}
    with contextlib.ExitStack() as stack:
        if cpus is not None:
            env["HOME"] = stack.enter_context(tempfile.TemporaryDirectory())
            stack.enter_context(contextlib.chdir(env["HOME"]))
            stack.enter_context(mock.patch("os.cpu_count", return_value=cpus))
            stack.enter_context(
                mock.patch("os.sched_getaffinity", return_value=set(range(cpus)), create=True)
            )
        stack.enter_context(mock.patch.dict(os.environ, env, clear=True))
        return {"": top_parser(), **{name: part_parser(name) for name in PARTS}}


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> Iterator[tuple[tuple, Any, str]]:
    """``(path, parser, one-line help)`` of every command below ``parser``, depth first, as listed."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield (*path, name), sub, helps.get(name, "")
                yield from _commands(sub, (*path, name))


def _resolved(action: argparse.Action) -> tuple[Any, bool]:
    """The option's default and whether it is required, also where the parser leaves both to be resolved
    after parsing (from the environment or a config file: a default object with its own two)."""
    d = action.default
    return (
        (d.default, d.required) if hasattr(d, "default") and hasattr(d, "required") else (d, action.required)
    )


def _defaults(parsers: dict[str, argparse.ArgumentParser]) -> dict[tuple, Any]:
    commands = [
        ((n, *path), sub) for n, p in parsers.items() for path, sub, _ in [((), p, ""), *_commands(p, ())]
    ]
    return {(*path, a.dest): _resolved(a)[0] for path, sub in commands for a in sub._actions}


def _default(action: argparse.Action, machine: bool) -> str:
    value, required = _resolved(action)
    if required:
        return "required"
    if action.nargs == 0 or value in (None, argparse.SUPPRESS, "", [], ()):
        return ""
    if machine:
        return MACHINE
    return code(",".join(map(str, value)) if isinstance(value, list | tuple) else str(value))


def _help(action: argparse.Action, prog: str, machine: bool) -> str:
    """The help as ``--help`` shows it (``%(default)s`` and the like filled in)."""
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params.update(prog=prog, default=MACHINE if machine else _resolved(action)[0])
    if action.choices is not None:
        params["choices"] = ", ".join(map(str, action.choices))
    return text((action.help or "") % params)  # as argparse does: a help it cannot fill fails --help too


def _options(parser: argparse.ArgumentParser, path: tuple, machine: set, positionals: bool = True) -> str:
    """A table of the command's arguments: the flags (as ``--help`` spells them), defaults and help."""
    formatter = argparse.HelpFormatter(parser.prog)
    rows = []
    for action in parser._actions:
        skip = isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
        if skip or action.help == argparse.SUPPRESS or not (positionals or action.option_strings):
            continue
        dep = (*path, action.dest) in machine
        invocation = formatter._format_action_invocation(action)
        rows.append((code(invocation), _default(action, dep), _help(action, parser.prog, dep)))
    return table(("option", "default", "what it does"), rows) if rows else "No options.\n\n"


def _description(parser: argparse.ArgumentParser, fallback: str) -> str:
    about = parser.description or fallback
    if not about.strip():
        return ""
    if issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter):
        return "```text\n" + textwrap.dedent(about).strip("\n") + "\n```\n\n"
    return text(about) + "\n\n"


def cli_page() -> str:
    parsers = _parsers()
    elsewhere = _defaults(_parsers(cpus=(os.cpu_count() or 1) + 3))  # as built on another machine
    machine = {k for k, v in _defaults(parsers).items() if v != elsewhere.get(k)}
    out = [
        header("Command line", "the argparse tree of `fleetbatch`", CLI_INTRO),
        "## Global options\n\n`fleetbatch [options] PART COMMAND ...`: the global options go before the part "
        "and reach every process the command starts.\n\n",
        _options(parsers[""], ("",), machine, positionals=False),
    ]
    for name in PARTS:
        commands = list(_commands(parsers[name], (name,)))
        out.append(f"## fleetbatch {name}\n\n" + _description(parsers[name], ""))
        out.append(table(("command", "what it does"), [(link(sub.prog), text(t)) for _, sub, t in commands]))
        for path, sub, what in commands:
            out.append(f"{'#' * min(1 + len(path), 6)} {sub.prog}\n\n" + _description(sub, what))
            if not any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                out.append(_options(sub, path, machine))
    out.append("## fleetbatch completion\n\n`fleetbatch completion bash|zsh|tcsh` prints a shell completion script "
               "for the whole tree (`fleetbatch completion bash > ~/.local/share/bash-completion/completions/fleetbatch`).\n")  # fmt: skip
    return "".join(out)


# --------------------------------------------------------------------------------------------- grpc.md


def proto_comments(source: str) -> dict[str, str]:
    """The comments of a ``.proto`` file by element (``Service.Rpc``, ``Message.field``, ``Enum.VALUE``...):
    the ``//`` lines above it (but lines of dashes) and the one that ends its line."""
    out: dict[str, str] = {}
    scope: list[tuple[str, str]] = []  # (kind, name) of the blocks the line is in
    pending: list[str] = []

    def keep(name: str, trailing: str) -> None:
        if words := " ".join([*pending, trailing.strip()]).strip():
            out[".".join([*(n for kind, n in scope if kind != "oneof"), name])] = words

    for raw in source.splitlines():
        line = raw.strip()
        if line.startswith("//"):
            if not line[2:].strip().startswith("---"):
                pending.append(line[2:].strip())
            continue
        code, _, trailing = (part.strip() for part in line.partition("//"))
        for piece in (p.strip() for p in re.findall(r"[^{};]*[{};]|[^{};]+$", code)):
            block = re.match(r"(service|message|enum|oneof)\s+(\w+)\s*\{", piece)
            kind = scope[-1][0] if scope else ""
            rpc = re.match(r"rpc\s+(\w+)", piece) if kind == "service" else None
            value = re.match(r"(\w+)\s*=\s*-?\d+", piece) if kind == "enum" else None
            field = re.match(r"(?:repeated\s+|optional\s+)?(?:map\s*<[^>]*>|[\w.]+)\s+(\w+)\s*=\s*\d+", piece)
            if block:
                keep(block.group(2), "" if "}" in code else trailing)
                scope.append((block.group(1), block.group(2)))
            elif match := rpc or value or (field if kind in ("message", "oneof") else None):
                keep(match.group(1), trailing)
            elif piece == "}" and scope:
                scope.pop()
            pending = []
    return out


def _type(field) -> str:
    """A field's type as the ``.proto`` file writes it, messages and enums linked to their section."""
    from google.protobuf.descriptor_pb2 import FieldDescriptorProto

    def name(f) -> str:
        linked = f.message_type or f.enum_type
        return linked.name if linked is not None else FieldDescriptorProto.Type.Name(f.type)[5:].lower()

    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return code("map<{}, {}>".format(*map(name, field.message_type.fields)))
    shown = link(name(field)) if field.message_type or field.enum_type else code(name(field))
    oneof = field.containing_oneof  # proto3's `optional` is a oneof of one, named after the field
    optional = oneof is not None and oneof.name == "_" + field.name
    return ("repeated " if field.is_repeated else "optional " if optional else "") + shown


def grpc_page() -> str:
    from protos import fleetbatch_pb2

    file = fleetbatch_pb2.DESCRIPTOR
    notes = proto_comments(importlib.resources.files("protos").joinpath("fleetbatch.proto").read_text())

    def section(name: str) -> str:
        return f"### {name}\n\n" + (text(notes[name]) + "\n\n" if name in notes else "")

    def arg(t, streaming: bool) -> str:
        return ("stream " if streaming else "") + link(t.name)

    out = [header("gRPC API", "`protos/fleetbatch.proto`", GRPC_INTRO.format(package=file.package))]
    out.append("## Services\n\n")
    for s in file.services_by_name.values():
        rows = [(f"`{m.name}`", arg(m.input_type, m.client_streaming), arg(m.output_type, m.server_streaming),
                 text(notes.get(f"{s.name}.{m.name}", ""))) for m in s.methods]  # fmt: skip
        out += [section(s.name), table(("RPC", "request", "response", "what it does"), rows)]
    out.append("## Messages\n\n")
    for m in file.message_types_by_name.values():
        rows = [(f"`{f.name}`", str(f.number), _type(f), text(notes.get(f"{m.name}.{f.name}", "")))
                for f in m.fields]  # fmt: skip
        out += [section(m.name), table(("field", "number", "type", "meaning"), rows)]
    out.append("## Enums\n\n")
    for e in file.enum_types_by_name.values():
        rows = [(f"`{v.name}`", str(v.number), text(notes.get(f"{e.name}.{v.name}", ""))) for v in e.values]
        out += [section(e.name), table(("value", "number", "meaning"), rows)]
    return "".join(out)


# ------------------------------------------------------------------------------------------ metrics.md


class _Stub:
    """Any attribute of an engine or a worker, to run their collectors without one: 0, or one stub, or itself."""

    __getattr__, __call__, __iter__ = (lambda s, *_: s), (lambda s, *_: s), (lambda s: iter([s]))
    __getitem__, __format__ = (lambda s, _: 0.0), (lambda s, _: "0")
    __bool__, __len__, __str__ = (lambda s: False), (lambda s: 0), (lambda s: "0")


def _families(families: Iterable) -> list[tuple[str, ...]]:
    """(name as exported, type, labels, help) of each metric family, as a scrape shows them."""
    suffix = {"counter": "_total", "histogram": "_bucket, _sum, _count"}
    rows = []
    for f in families:
        labels = ", ".join(dict.fromkeys(k for s in f.samples for k in s.labels if k != "le"))
        rows.append((code(f.name + suffix.get(f.type, "")), f.type, labels, text(f.documentation)))
    return rows


def metrics_page() -> str:
    from prometheus_client.metrics import MetricWrapperBase

    from engines.metrics import StageCollector, WorkerCollector
    from gateway.status.metrics import GatewayMetrics

    gateway = GatewayMetrics()
    for metric in vars(gateway).values():  # one series of each labelled metric, so that it is exported
        if isinstance(metric, MetricWrapperBase) and metric._labelnames:
            metric.labels(*metric._labelnames)
    engine = [*StageCollector(_Stub()).collect(), *WorkerCollector(_Stub()).collect()]
    head = ("metric", "type", "labels", "what it counts")
    return "".join([
        header("Prometheus metrics", "`gateway/status/metrics.py` and `engines/metrics.py`", METRICS_INTRO),
        "## Gateway\n\n`fleetbatch gateway serve --metrics-port PORT` (also `gateway up`), on `--metrics-host` "
        "(loopback by default), refreshed at every offloader tick (0.5 s). A scrape sends the admin token "
        "(`$FLEETBATCH_ADMIN_TOKEN`) as `Authorization: Bearer <token>`, else 401; the endpoint does not "
        "start without one. The `batch` series cover at most `--metrics-batches` (100) unfinished batches, "
        "those at risk first, then the earliest finish; a finished batch's series go at the next refresh.\n\n",
        table(head, _families(gateway.registry.collect())),
        "## Engine\n\n`fleetbatch engine serve --metrics-port PORT`, on every address. `fleetbatch_stage_*`: one "
        "series per pipeline stage of a plan with several; `fleetbatch_worker_*`: the worker and its queue agent.\n\n",
        table(head, _families(engine)),
    ])  # fmt: skip


# --------------------------------------------------------------------------------------------- http.md

#: what each route does (a route of the app missing here, or one here that the app lacks, is an error)
ROUTES = {
    "POST /v1/files": "Upload a batch input file (multipart, `purpose=batch`); answers the file object.",
    "GET /v1/files": "List file objects (`purpose`, `limit` 1..10000, `order`, `after`), with `has_more`.",
    "GET /v1/files/{file_id}": "One file object.",
    "DELETE /v1/files/{file_id}": "Delete a file; 409 while it is the input of a batch not finalized yet.",
    "GET /v1/files/{file_id}/content": "The file's bytes (an input, output or error file).",
    "POST /v1/batches": "Create a batch: `input_file_id`, `endpoint`, `completion_window`, `metadata`, `priority`.",
    "GET /v1/batches": "The batches created over HTTP, newest first (`limit`, `after`).",
    "GET /v1/batches/{batch_id}": "One batch object, with the `fleetbatch` field (deadline, priority, ETA).",
    "POST /v1/batches/{batch_id}/cancel": "Cancel a batch; 409 for one that is already over.",
    "GET /status": "The status page (HTML; it asks for the key and reads `/v1/fleet/status`).",
    "GET /v1/fleet/status": "The status page's data as JSON: clusters, newest batches, the fleet's throughput.",
    "GET /healthz": "`{\"status\": \"ok\"}` while this replica reaches Redis, else 503 (Kubernetes' readiness probe).",
}


def http_page() -> str:
    from gateway.config import GatewayConfig
    from gateway.http_api.front import OpenAIFront

    service = SimpleNamespace(d=SimpleNamespace(eta=None))  # of the batch service, the front reads its ETAs
    app = OpenAIFront(service, None, GatewayConfig(), None, None).app()
    public = {p for m in app.user_middleware for p in m.kwargs.get("public", ())}
    routes = [(method, r.path) for r in app.routes for method in sorted(set(r.methods) - {"HEAD"})]
    if differ := {f"{m} {p}" for m, p in routes} ^ set(ROUTES):
        raise ValueError(f"fleetbatch.reference.ROUTES and the app's routes differ: {sorted(differ)}")
    rows = [(f"`{m}`", code(p), "none" if p in public else "Bearer key", text(ROUTES[f"{m} {p}"]))
            for m, p in routes]  # fmt: skip
    head = ("method", "path", "auth", "what it does")
    return header("HTTP API", "the routes of `gateway/http_api/front.py`", HTTP_INTRO) + table(head, rows)


# ------------------------------------------------------------------------------------------- the pages

#: each generated page (its path under docs/) and the function that writes it
PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_page,
    "reference/grpc.md": grpc_page,
    "reference/metrics.md": metrics_page,
    "reference/http.md": http_page,
    "reference/vocabulary.md": reference_schemas.vocabulary_page,
    "reference/cluster-file.md": reference_schemas.cluster_file_page,
    "reference/config-file.md": reference_schemas.config_file_page,
}


def render() -> dict[str, str]:
    """Every generated page: its path under ``docs/`` -> its text."""
    return {path: page().rstrip("\n") + "\n" for path, page in PAGES.items()}


def stale(pages: dict[str, str], docs: Path = DOCS) -> list[str]:
    """The pages whose file under ``docs`` is missing or differs from ``pages``."""
    return [p for p, page in pages.items() if not (docs / p).is_file() or (docs / p).read_text() != page]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser("python -m fleetbatch.reference", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the stale pages")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the docs directory (default: the project's)")
    args = parser.parse_args(argv)
    pages = render()
    for path in (bad := stale(pages, args.docs)):
        if args.check:
            print(f"stale: docs/{path} (run: python -m fleetbatch.reference)", file=sys.stderr)
            continue
        (args.docs / path).parent.mkdir(parents=True, exist_ok=True)
        (args.docs / path).write_text(pages[path])
        print(f"wrote docs/{path}")
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
