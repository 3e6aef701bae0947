"""`fleetbatch loadgen openai-check`: the OpenAI batch flow with the official ``openai`` client against ``fleetbatch gateway up``.

Starts ``fleetbatch gateway up`` (embedded Redis, its default fleet of engines, the gateway with its
OpenAI-compatible HTTP front on a free port, its files in ``--files``: a directory, or S3-compatible
object storage), writes ``-n`` queries of a workload (by default
the mixed workload of ``../shared/data``) as an OpenAI batch input file (``/v1/chat/completions``:
each prompt a user message, ``max_tokens`` its recorded response length; or
``/v1/completions``), then with ``OpenAI(base_url=..., api_key=...)``: uploads it, creates the
batch, polls it to a final state, downloads the output and error files and checks every line
against OpenAI's batch output shape (:func:`line_problems`), and the final batch object's
``usage`` and times against them (:func:`batch_problems`). It also reads the batch over gRPC (the same id,
with the admin token: the batch is the HTTP front's). The last line printed is one JSON object: ``requests``, ``completed``, ``failed``,
``output_lines``, ``output_lines_valid``, ``error_lines``, ``status``, ``grpc_status``, ``usage``,
``wall_s`` (upload to the output downloaded) and ``tokens_per_s``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from gateway.grpc_api.tls import channel
from gateway.http_api.format import CHAT, COMPLETIONS
from load.deployment import LocalDeployment
from load.workload import WorkItem, from_dataset, generated
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc

FINAL = ("completed", "failed", "cancelled", "expired")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--num-queries", type=int, default=200, help="requests in the batch")
    p.add_argument("--dataset", default="mixed", help="dataset of ../shared/data, or 'generated'")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the workload")
    p.add_argument("--max-tokens", type=int, default=256, help="cap of each request's max_tokens")
    p.add_argument("--endpoint", default=CHAT, choices=(CHAT, COMPLETIONS), help="the batch's endpoint")
    p.add_argument("--run-dir", default="runs/openai-check", help="run directory of `fleetbatch gateway up`")
    p.add_argument(
        "--gateway-arg", action="append", help="extra argument for `fleetbatch gateway up` (repeatable)"
    )
    p.add_argument("--predictor", default="shipped", help="length predictor of the gateway")
    p.add_argument(
        "--files",
        default=None,
        help="the gateway's file store: a directory or s3://BUCKET/PREFIX (AWS_* from the environment; "
        "default: RUN_DIR/files)",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed for the deployment and batch")


def line_problems(line: dict, endpoint: str) -> list[str]:
    """What is wrong with one line of an OpenAI batch output or error file (empty: nothing)."""
    if not isinstance(line, dict) or set(line) != {"id", "custom_id", "response", "error"}:
        return [
            f"keys must be id, custom_id, response, error: {sorted(line) if isinstance(line, dict) else line}"
        ]
    out = [] if str(line["id"]).startswith("batch_req_") else ["id must start with batch_req_"]
    if not isinstance(line["custom_id"], str) or not line["custom_id"]:
        out.append("custom_id must be a non-empty string")
    if line["error"] is not None:
        err = line["error"]
        ok = line["response"] is None and isinstance(err, dict) and {"code", "message"} <= set(err)
        return out + ([] if ok else ["an error line needs response null and error {code, message}"])
    resp = line["response"] or {}
    if resp.get("status_code") != 200 or not resp.get("request_id"):
        out.append("response needs status_code 200 and a request_id")
    body = resp.get("body") or {}
    kind = "chat.completion" if endpoint == CHAT else "text_completion"
    if body.get("object") != kind:
        out.append(f"body.object must be {kind}, not {body.get('object')!r}")
    if not all(isinstance(body.get(k), t) for k, t in (("id", str), ("created", int), ("model", str))):
        out.append("body needs id, created and model")
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        return out + ["body.choices must hold one choice"]
    c = choices[0]
    text = (c.get("message") or {}).get("content") if endpoint == CHAT else c.get("text")
    if endpoint == CHAT and (c.get("message") or {}).get("role") != "assistant":
        out.append("the choice's message must be the assistant's")
    if c.get("index") != 0 or c.get("finish_reason") not in ("stop", "length") or not isinstance(text, str):
        out.append("the choice needs index 0, finish_reason stop|length and its text")
    u = body.get("usage") or {}
    counts = [u.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")]
    if not all(isinstance(x, int) and x >= 0 for x in counts) or counts[0] + counts[1] != counts[2]:
        out.append(f"usage must hold prompt, completion and total tokens that add up: {u}")
    return out


def batch_problems(batch, out: list[dict]) -> list[str]:
    """What is wrong with a final batch object given its output lines (empty: nothing): its ``usage``
    must be the sum of the lines' ``usage``, and ``created_at <= in_progress_at <= completed_at``."""
    usages = [x["response"]["body"].get("usage") or {} for x in out if x.get("response")]
    want = [sum(int(u.get(k) or 0) for u in usages) for k in ("prompt_tokens", "completion_tokens")]
    u = batch.usage
    got = [u.input_tokens, u.output_tokens] if u is not None else None
    problems = []
    if got != want or (u is not None and u.total_tokens != sum(want)):
        problems.append(f"batch usage {got} is not the output lines' prompt and completion tokens {want}")
    done = batch.completed_at or batch.failed_at or batch.cancelled_at
    if batch.in_progress_at is None or not batch.created_at <= batch.in_progress_at <= (done or 2**62):
        problems.append(f"in_progress_at {batch.in_progress_at} is not between created_at and the end")
    return problems


def input_rows(items: list[WorkItem], endpoint: str) -> list[dict]:
    """The OpenAI batch input lines of a workload (``max_tokens``: the recorded length, capped)."""
    rows = []
    for it in items:
        body: dict = {"model": "fleetbatch", "max_tokens": it.forced_length or it.max_tokens}
        if endpoint == CHAT:
            body["messages"] = [{"role": "user", "content": it.prompt}]
        else:
            body["prompt"] = it.prompt
        rows.append({"custom_id": it.id, "method": "POST", "url": endpoint, "body": body})
    return rows


def _workload(args) -> list[WorkItem]:
    if args.dataset == "generated":
        return generated(args.num_queries, args.seed, args.max_tokens, True)
    from localmodels import default_tokenizer

    return from_dataset(args.dataset, args.num_queries, args.seed, args.max_tokens, True, default_tokenizer())


def _flow(
    client, data: bytes, endpoint: str, timeout_s: float
) -> tuple[object, list[dict], list[dict], float]:
    """Upload, create, poll, download: (final batch, output lines, error lines, seconds)."""
    t0 = time.time()
    f = client.files.create(file=("input.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
    deadline = time.monotonic() + timeout_s
    while batch.status not in FINAL:
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch.id} still {batch.status} after {timeout_s:.0f} s")
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)

    def lines(file_id: str | None) -> list[dict]:
        return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []

    out, err = lines(batch.output_file_id), lines(batch.error_file_id)
    return batch, out, err, time.time() - t0


def run(args) -> dict:
    try:
        from openai import OpenAI
    except ImportError:
        raise ValueError(
            "fleetbatch loadgen openai-check needs the openai package: pip install openai"
        ) from None
    if args.num_queries < 1:
        raise ValueError("--num-queries must be >= 1")
    for name in ("httpx", "httpx2"):  # the client logs every poll at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    items = _workload(args)
    rows = input_rows(items, args.endpoint)
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    up_args = [
        "--predictor",
        args.predictor,
        *(["--files", args.files] if args.files else []),
        *(args.gateway_arg or []),
    ]
    with LocalDeployment(args.run_dir, up_args, args.timeout) as info:
        if "http_url" not in info:
            raise ValueError("`fleetbatch gateway up` started no HTTP front (was --http-port negative?)")
        key = Path(info["http_api_key_file"]).read_text().strip()
        client = OpenAI(base_url=info["http_url"], api_key=key, max_retries=2)
        batch, out, err, wall = _flow(client, data, args.endpoint, args.timeout)
        admin = Path(info["admin_token_file"]).read_text().strip()  # the front's batch: the admin's to read
        with channel(info["address"], token=admin) as ch:
            same = pb_grpc.BatchServiceStub(ch).GetBatch(pb.GetBatchRequest(batch_id=batch.id), timeout=30)
    wanted = {r["custom_id"] for r in rows}
    seen = [x.get("custom_id") for x in out + err]
    valid = sum(1 for x in out if not line_problems(x, args.endpoint))
    problems = sorted({p for x in out + err for p in line_problems(x, args.endpoint)})
    problems += batch_problems(batch, out)
    tokens = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out if x.get("response"))
    return {
        "command": "openai-check",
        "batch_id": batch.id,
        "endpoint": args.endpoint,
        "dataset": args.dataset,
        "files": args.files or "RUN_DIR/files",
        "requests": len(rows),
        "status": batch.status,
        "grpc_status": pb.BatchStatus.Name(same.status).lower(),
        "completed": batch.request_counts.completed,
        "failed": batch.request_counts.failed,
        "output_lines": len(out),
        "output_lines_valid": valid,
        "error_lines": len(err),
        "missing": len(wanted - set(seen)),
        "duplicates": len(seen) - len(set(seen)),
        "problems": problems[:10],
        "completion_tokens": tokens,
        "usage": batch.usage.model_dump() if batch.usage is not None else None,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1) if wall > 0 else 0.0,
    }
