"""The ``loadgen`` command: submit workloads to a gateway, run the local demo, and benchmarks."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import grpc

from cliutil import run_main
from fleetdata.datasets import data_dir
from gateway.grpc_api.auth import CLIENT_TOKEN_ENV, client_token, deployment_token
from gateway.http_api.format import ChatTemplate
from load.chaos import run as chaos
from load.client import PART_ROWS, Tally, format_summary, run_batch
from load.deployment import LocalDeployment
from load.openai_batch import OpenAIOutput, error_path
from load.reports import report
from load.reports.layout import format_layouts, mean_lengths, plan_rows
from load.soaks import endpoints, file_create, file_soak, openai_check, soak
from load.studies import bench_offload, compare_policies, deadlines, prefix, spot, study, wan
from load.workload import OpenAIFile, from_dataset, generated

log = logging.getLogger(__name__)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--dataset",
        help="a dataset of ../shared/data: mixed, alpaca_eval, gsm8k, code_alpaca, roleplay, toolformer",
    )
    src.add_argument(
        "--jsonl",
        help="an OpenAI Batch input file (custom_id, body.messages / body.prompt), sent whole and streamed "
        "(read row by row, sent in parts: any size)",
    )
    p.add_argument(
        "-n",
        "--num-queries",
        type=int,
        default=None,
        help="number of queries, generated or sampled (default 200); with --jsonl a cap: the first N rows "
        "(default: every row; a warning names the rows left out)",
    )
    p.add_argument(
        "--served-model",
        default=None,
        metavar="DIR",
        help="with --jsonl: the served model's directory (Hugging Face): chat rows are rendered with its "
        "tokenizer's chat template, as the gateway renders and counts them",
    )
    p.add_argument(
        "--chat-template",
        choices=["default"],
        default=None,
        help="with --jsonl and no --served-model: 'default' renders chat rows with the documented <|role|> "
        "headers (the project's own random models); with neither, a chat row is refused",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each query")
    p.add_argument("--no-forced", action="store_true", help="do not force the recorded response length")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the workload")
    p.add_argument("--out", default=None, help="write results as JSONL here")
    p.add_argument(
        "--openai-out",
        default=None,
        help="with --jsonl: also write OpenAI Batch output here (errors to NAME_errors.jsonl beside it)",
    )
    p.add_argument(
        "--model-name",
        help="model in the OpenAI output bodies (default: each request's own, else fleetbatch)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser(prog: str = "fleetbatch loadgen") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Load generation for fleetbatch: submit batches (generated, real datasets, OpenAI batch JSONL), "
        "stream results, summarise per cluster; run the local demo; compare assignment policies.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "submit", help="submit one batch to a gateway, stream results, print a per-cluster summary"
    )
    s.add_argument("--target", default="127.0.0.1:50051", help="gateway address host:port")
    s.add_argument("--batch-id", default="", help="client-chosen batch id (makes retries idempotent)")
    s.add_argument(
        "--resume",
        metavar="BATCH_ID",
        default=None,
        help="submit nothing: stream on from the results of BATCH_ID already in --out (appended, no duplicates)",
    )
    s.add_argument(
        "--on-bad-query",
        choices=("reject", "fail-row"),
        default=None,
        help="a bad query rejects the batch, or fails alone (default: the gateway's setting)",
    )
    s.add_argument("--tls-ca", default=None, help="CA certificate (PEM): connect to the gateway over TLS")
    s.add_argument(
        "--token", default=None, help=f"client token (default: ${CLIENT_TOKEN_ENV} or --token-file)"
    )
    s.add_argument(
        "--token-file",
        default="runs/local/client-token",
        help="file holding the client token (default: fleetbatch gateway up's, when it exists)",
    )
    _add_workload_args(s)
    s.add_argument(
        "--part-rows",
        type=int,
        default=PART_ROWS,
        help=f"with --jsonl: queries per message of the batch sent in parts (default {PART_ROWS})",
    )

    d = sub.add_parser(
        "demo",
        help="start `fleetbatch gateway up` (embedded Redis, 3 engines), submit a sample batch, print the summary, stop",
    )
    d.add_argument(
        "--run-dir", default="runs/demo", help="where `fleetbatch gateway up` keeps Redis data and logs"
    )
    d.add_argument(
        "--gateway-arg", action="append", help="extra argument for `fleetbatch gateway up` (repeatable)"
    )
    d.add_argument(
        "--predictor",
        default="shipped",
        help="length predictor: shipped (the learned model shipped with the project), heuristic, or a model dir",
    )
    d.add_argument(
        "--timeout", type=float, default=600, help="seconds to wait for the deployment and the batch"
    )
    _add_workload_args(d)

    c = sub.add_parser(
        "compare-policies",
        help="benchmark: per-cluster token imbalance and makespan of each assignment policy on real lengths",
    )
    compare_policies.add_arguments(c)
    b = sub.add_parser(
        "bench-offload",
        help="benchmark: a batch on a fleet with one slow cluster, with and without backoff offloading",
        description=bench_offload.__doc__,
    )
    bench_offload.add_arguments(b)
    for name, module, help_text in (
        (
            "chaos",
            chaos,
            "fault injection: kill engines, gateway and Redis under a running batch; count lost queries",
        ),
        (
            "study",
            study,
            "MICO's study for real: {round robin, token} x {static, iteration-level} through fleetbatch gateway up",
        ),
        (
            "wan",
            wan,
            "the same batch with every engine 0-100 ms (one way) from Redis: device-busy fraction, makespan",
        ),
        (
            "deadlines",
            deadlines,
            "batches with different completion windows: earliest deadline first against FIFO, the ETA's error",
        ),
        (
            "prefix",
            prefix,
            "a batch with shared prefixes: token-only against prefix-aware assignment, prefix cache on (and off)",
        ),
        (
            "spot",
            spot,
            "spot clusters preempted and killed: --policy cost against token and an on-demand fleet",
        ),
        (
            "report",
            report,
            "a run directory's throughput, makespan, tokens per cluster, completion CDF and plots",
        ),
        (
            "soak",
            soak,
            "one large batch submitted and streamed back through one gateway, predictor off and on",
        ),
        (
            "file-soak",
            file_soak,
            "a million-row OpenAI batch file sent whole by `fleetbatch loadgen submit --jsonl`: the client's peak memory, "
            "every row once",
        ),
        (
            "file-create",
            file_create,
            "a batch created over HTTP from a 200 MB input file (a directory or s3:// store): the gateway's "
            "memory before and at its peak",
        ),
        (
            "endpoints",
            endpoints,
            "the endpoint backend against a plain client at each fixed concurrency, on one transformers serve "
            "(server on one core, the rest on another): efficiency, prompt counts, a server killed",
        ),
        (
            "openai-check",
            openai_check,
            "the OpenAI batch flow (files, batches, output) with the openai client against fleetbatch gateway up",
        ),
    ):
        sp = sub.add_parser(name, help=help_text, description=module.__doc__, formatter_class=RAW)
        module.add_arguments(sp)
    return p


RAW = argparse.RawDescriptionHelpFormatter


DEFAULT_NUM = 200


def _workload(args):
    """The generated or sampled workload (``--num-queries``, 200 by default), or a ``--jsonl`` file's first rows."""
    num = DEFAULT_NUM if args.num_queries is None else args.num_queries
    if num < 1:
        raise ValueError("--num-queries must be >= 1")
    if args.jsonl:
        return list(_openai_file(args, num))
    forced = not args.no_forced
    if args.dataset:
        from localmodels import default_tokenizer  # lazy: transformers (loadgen starts without)

        return from_dataset(args.dataset, num, args.seed, args.max_tokens, forced, default_tokenizer())
    return generated(num, args.seed, args.max_tokens, forced)


def _openai_file(args, limit: int | None) -> OpenAIFile:
    """``--jsonl`` read row by row, chat rows rendered with ``--served-model``'s template (or the documented
    default, ``--chat-template default``; neither: a chat row is an error naming both)."""
    tokenizer = None
    if args.served_model:
        from transformers import AutoTokenizer  # lazy: loadgen starts without transformers

        tokenizer = AutoTokenizer.from_pretrained(args.served_model)
    template = ChatTemplate.of(tokenizer, args.chat_template, args.served_model)
    return OpenAIFile(args.jsonl, args.max_tokens, template, limit)


def _jsonl_source(args) -> OpenAIFile:
    """``submit --jsonl``: the whole file (``--num-queries``: a cap, with a warning naming the rows it leaves out)."""
    if args.num_queries is not None and args.num_queries < 1:
        raise ValueError("--num-queries must be >= 1")
    if args.part_rows < 1:
        raise ValueError("--part-rows must be >= 1")
    source = _openai_file(args, args.num_queries)
    left = source.rows_after(args.num_queries) if args.num_queries is not None else 0
    if left:
        print(f"fleetbatch loadgen submit: --num-queries {args.num_queries} sends the first {args.num_queries} rows of {args.jsonl}; "
              f"{left} rows are left out", file=sys.stderr)  # fmt: skip
    return source


def _submit(
    args, target: str, token: str | None = None, layouts: dict | None = None, items: list | None = None
) -> int:
    """Submit the workload (``items``, else ``--num-queries`` queries of it, or the whole ``--jsonl`` file sent in
    parts and never held whole) and summarise the results as they come (no result row is kept)."""
    resume = getattr(args, "resume", None)
    if resume and not args.out:
        raise ValueError("--resume needs --out: the file that holds the results seen so far")
    openai_out = getattr(args, "openai_out", None)
    if openai_out and not args.jsonl:
        raise ValueError("--openai-out needs --jsonl: the OpenAI batch input it answers")
    source = None
    if items is None and not resume:
        source = _jsonl_source(args) if args.jsonl else None
        items = _workload(args) if source is None else None
    tally = Tally()
    writer = None
    if openai_out:
        file = source or _openai_file(args, None)
        model = (lambda _: args.model_name) if args.model_name else file.model
        writer = OpenAIOutput(openai_out, file.endpoint, model)
    try:
        batch, _, wall = run_batch(
            target,
            (lambda: iter(source)) if source is not None else (items or []),
            batch_id=resume or getattr(args, "batch_id", ""),
            progress=not args.no_progress,
            out=args.out,
            resume=bool(resume),
            on_bad_query=getattr(args, "on_bad_query", None) or "",
            tls_ca=getattr(args, "tls_ca", None),
            token=token if token is not None else client_token(args.token, args.token_file),
            on_row=lambda row: (tally.add(row), writer and writer.write(row)),
            keep=False,
            part_rows=getattr(args, "part_rows", PART_ROWS),
            seen=tally.ids,
        )
    finally:
        if writer is not None:
            writer.close()
    if args.out:
        print(f"results written to {args.out}")
    if writer is not None:
        print(
            f"OpenAI batch output: {writer.ok} lines in {openai_out}, {writer.bad} in {error_path(openai_out)}"
        )
    summary = tally.summary(batch, wall)
    print(format_summary(summary))
    if layouts:
        summary["plans"] = plan_rows(layouts, summary)
        print("plan against measurement per cluster:\n" + format_layouts(layouts, summary["plans"]))
    print(json.dumps(summary))
    return 0 if summary["results"] == summary["queries"] and summary["duplicates"] == 0 else 1


def demo_dataset(args) -> str | None:
    """The demo's workload: what the user chose, else the mixed real workload (real prompts with
    their recorded lengths) where the data directory exists, else None (the generated mix)."""
    if args.dataset or args.jsonl:
        return args.dataset
    try:
        data_dir()
    except FileNotFoundError:
        return None
    return "mixed"


def _demo(args) -> int:
    args.dataset = demo_dataset(args)
    print(
        f"workload: {args.dataset + ' (real prompts, recorded lengths)' if args.dataset else 'generated mix'}",
        flush=True,
    )
    items = _workload(args)
    prompt, output = mean_lengths(items)  # the fleet is planned for this workload's lengths
    up_args = [
        "--predictor",
        args.predictor,
        "--fleet-lengths",
        f"{prompt},{output}",
        *(args.gateway_arg or []),
    ]
    print("starting: fleetbatch gateway up", " ".join(up_args), flush=True)
    try:
        with LocalDeployment(args.run_dir, up_args, args.timeout, quiet=False) as info:
            layouts = info.get("layouts") or {}
            if layouts:
                print("planned layout per cluster:\n" + format_layouts(layouts), flush=True)
            return _submit(args, info["address"], deployment_token(info), layouts, items)
    except (RuntimeError, TimeoutError) as e:
        print(f"fleetbatch loadgen demo: {e}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    if args.command == "submit":
        return _submit(args, args.target)
    if args.command == "demo":
        return _demo(args)
    modules = {"bench-offload": bench_offload, "compare-policies": compare_policies}
    modules.update(chaos=chaos, study=study, report=report, soak=soak)
    modules["file-soak"] = file_soak
    modules["file-create"] = file_create
    modules["openai-check"] = openai_check
    modules["wan"] = wan
    modules["deadlines"] = deadlines
    modules["prefix"] = prefix
    modules["spot"] = spot
    modules["endpoints"] = endpoints
    result = modules[args.command].run(args)
    print(json.dumps(result))
    return (
        1 if isinstance(result, dict) and result.get("ok") is False else 0
    )  # chaos: a count above 0, or a fault that did not fire


def main(argv: list[str] | None = None, prog: str = "fleetbatch loadgen") -> int:
    return run_main(
        build_parser(prog),
        argv,
        run,
        prog=prog,
        errors=(grpc.RpcError, FileNotFoundError, ValueError, TimeoutError),
        message="{prog}{command}: {error}",
        describe=lambda e: f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e),
    )


if __name__ == "__main__":
    sys.exit(main())
