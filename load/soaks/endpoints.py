"""`fleetbatch loadgen endpoints`: the endpoint backend's scheduling against the best fixed concurrency.

One ``transformers serve --continuous-batching`` (a random-weights Llama, ``--size small`` by
default, saved with a chat tokenizer whose template has turn tokens and a BOS:
:mod:`localmodels.chat_model`) gets the same batch twice: ``-n`` chat rows (200) of the mixed workload's
real prompts (``../shared/data``), each a user message whose ``max_tokens`` is its recorded response
length capped at ``--max-tokens``, greedy (temperature 0, a fixed seed per row):

(a) from a plain asyncio client (httpx, streamed, the server's usage) straight to the server, at each
    fixed concurrency of ``--concurrency`` (1, 2, 4, ..., 128), keeping the best completion tokens/s;
(b) through the real gateway (``fleetbatch gateway serve --served-model MODEL_DIR``: it counts prompt
    tokens with the model's tokenizer and chat template; gRPC ``SubmitBatch`` with each row's messages)
    and a real ``fleetbatch engine serve --backend endpoint --endpoint-url URL``, whose flow control
    finds its own concurrency, on an embedded Redis.

On a machine of two cores or more the server is pinned to ``--server-cpus`` (core 1) and every other
process (this command, Redis, the gateway, the engine) to ``--client-cpus`` (core 0), in both runs, so
the ratio measures scheduling, not CPU contention. The server warms up (untimed) before (a).

With ``--kill-server`` the server is killed by its pid once ``--kill-at`` of run (b)'s rows are back and
started again on the same port (its efficiency is then not a measure of anything): every row must come
back once, none failed.

The last line printed is one JSON object: ``endpoint_efficiency`` (completion tokens/s of (b) over the
best of (a); goal >= 0.95), ``best_fixed_concurrency``, ``fixed`` (tokens/s per concurrency),
``endpoint_tokens_per_s``, ``prompt_count_mismatches`` (rows whose prompt tokens as the gateway counts
them differ from the server's ``usage.prompt_tokens``; goal 0), ``rows``, ``lost``, ``duplicated``,
``failed`` (0), ``server_kills_survived``. Logs of the server, gateway, engine and Redis: ``--run-dir``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from load.client import run_batch
from load.endpoint_server import EndpointServer
from load.soaks.endpoints_direct import direct_run, warm_up
from load.soaks.endpoints_procs import Deployment, pin_threads
from load.workload import from_dataset

log = logging.getLogger(__name__)

CONCURRENCIES = "1,2,4,8,16,32,64,128"
#: the server's continuous batching, its KV cache sized here: sized from the machine's whole memory on a CPU,
#: it takes a minute of zeroing at each start
SERVER_ARGS = ("--continuous-batching", "--cb-num-blocks", "1024", "--cb-max-batch-tokens", "1024")
MODEL_VERSION = 1  # bump when the built model changes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--num-queries", type=int, default=200, help="chat rows in the batch")
    p.add_argument("--dataset", default="mixed", help="dataset of ../shared/data the prompts come from")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the workload (row i: seed + i)")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="cap of each row's max_tokens (its recorded length)"
    )
    p.add_argument(
        "--concurrency",
        default=CONCURRENCIES,
        help=f"run (a)'s fixed concurrencies (default {CONCURRENCIES})",
    )
    p.add_argument(
        "--served-model",
        metavar="DIR",
        default=None,
        help="the chat model directory the server serves (default: a random llama of --size, built once "
        "in the cache)",
    )
    p.add_argument("--size", default="small", help="size of the built model: nano, micro, tiny, small, base")
    p.add_argument("--server-cpus", default="1", help="cores of the server (comma-separated)")
    p.add_argument(
        "--client-cpus", default="0", help="cores of everything else: this command, Redis, gateway, engine"
    )
    p.add_argument("--no-pin", action="store_true", help="pin nothing")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help=f"extra argument of transformers serve (repeatable; always given: {' '.join(SERVER_ARGS)})",
    )
    p.add_argument(
        "--kill-server", action="store_true", help="kill the server mid-batch in run (b), start it again"
    )
    p.add_argument(
        "--kill-at", type=float, default=0.3, help="share of run (b)'s rows back when the server is killed"
    )
    p.add_argument(
        "--engine-arg", action="append", default=[], help="extra argument of the engine (repeatable)"
    )
    p.add_argument("--predictor", default="heuristic", help="the gateway's length predictor")
    p.add_argument("--run-dir", default="runs/endpoints", help="logs and Redis data")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed for run (b)'s batch")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _cpus(text: str) -> set[int]:
    try:
        cpus = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise ValueError(f"cores must be comma-separated numbers, not {text!r}") from None
    if not cpus:
        raise ValueError("name at least one core")
    return cpus


def model_dir(args) -> Path:
    """``--served-model``, else the built chat model of ``--size`` (built once, cached)."""
    if args.served_model:
        path = Path(args.served_model)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
        return path.resolve()
    from localmodels.build import SIZES, default_corpus
    from localmodels.chat_model import build_chat_model
    from localmodels.paths import cache_dir

    if args.size not in SIZES:
        raise ValueError(f"unknown --size {args.size!r}; choose one of {', '.join(SIZES)}")
    path = cache_dir() / f"endpoints-chat-llama-{args.size}-v{MODEL_VERSION}"
    if not (path / "config.json").exists():
        log.info("building the chat model llama:%s -> %s", args.size, path)
        build_chat_model(path, args.size, vocab_size=8192, corpus=default_corpus(), max_positions=4096)
    return path


def batch_rows(args, model: Path, tokenizer) -> tuple[list[dict], list]:
    """The batch as OpenAI input lines, and the same as work items (the prompt the gateway's template renders)."""
    from gateway.http_api.format import ChatTemplate
    from gateway.server import token_counter
    from load.workload import _openai_item

    items = from_dataset(args.dataset, args.num_queries, args.seed, args.max_tokens, True, tokenizer)
    rows = []
    for i, it in enumerate(items):
        body = {
            "model": str(model),
            "messages": [{"role": "user", "content": it.prompt}],
            "max_tokens": it.forced_length or args.max_tokens,
            "temperature": 0.0,
            "top_p": 1.0,
            "seed": args.seed + i,
        }
        rows.append({"custom_id": it.id, "body": body})
    template = ChatTemplate.of(tokenizer, None, str(model))  # the served model's, as the gateway's
    work = [_openai_item(r, args.max_tokens, template) for r in rows]
    counts = token_counter(tokenizer)([w.prompt for w in work])
    config = json.loads((model / "config.json").read_text())
    limit = min(
        2048, int(config.get("max_position_embeddings") or 2048)
    )  # 2048: the gateway's longest prompt
    keep = [i for i, c in enumerate(counts) if c + rows[i]["body"]["max_tokens"] <= limit]
    if len(keep) < len(rows):
        log.warning(
            "%d rows left out: their prompt and max_tokens exceed %d tokens", len(rows) - len(keep), limit
        )
    return [rows[i] for i in keep], [work[i] for i in keep]


def fixed_runs(url: str, rows: list[dict], concurrencies: list[int], progress: bool) -> dict[int, dict]:
    """Run (a) at each concurrency: tokens/s, seconds, and the server's prompt tokens per row."""
    out = {}
    for c in concurrencies:
        r = direct_run(url, rows, c, progress)
        out[c] = {"tokens_per_s": r.tokens_per_s, "wall_s": r.wall_s, "tokens": r.completion_tokens,
                  "prompt_tokens": r.prompt_tokens}  # fmt: skip
        print(f"(a) concurrency {c}: {r.completion_tokens} tokens in {r.wall_s:.1f} s = "
              f"{r.tokens_per_s:.1f} tokens/s", file=sys.stderr, flush=True)  # fmt: skip
    return out


class _Killer:
    """Kills the server by its pid once ``at`` rows are back, and starts it again on the same port (a thread)."""

    def __init__(self, server: EndpointServer, at: int) -> None:
        self.server, self.at, self.seen, self.kills, self.restarted = server, at, 0, 0, threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def on_row(self, row: dict) -> None:
        self.seen += 1
        if self.thread is None and self.seen >= self.at:
            self.thread = threading.Thread(target=self._kill_and_start, daemon=True)
            self.thread.start()

    def _kill_and_start(self) -> None:
        try:
            pid = self.server.proc.pid
            self.server.kill()
            self.kills += 1
            print(f"(b) killed the server (pid {pid}) with {self.seen} rows back; starting it again",
                  file=sys.stderr, flush=True)  # fmt: skip
            self.server.start()
            print(f"(b) the server answers again (pid {self.server.proc.pid}, port {self.server.port})",
                  file=sys.stderr, flush=True)  # fmt: skip
        except BaseException as e:  # surfaced by the run
            self.error = e
        finally:
            self.restarted.set()


def gateway_run(args, server: EndpointServer, model: Path, work: list, run_dir: Path, cpus) -> dict:
    """Run (b): the batch through the gateway and an endpoint engine; counts, tokens/s, kills."""
    token = secrets.token_urlsafe(24)
    with Deployment(run_dir, model, server.url, token, args, cpus) as dep:
        killer = _Killer(server, max(1, int(len(work) * args.kill_at))) if args.kill_server else None
        batch, results, wall = run_batch(
            dep.address, work, progress=not args.no_progress, timeout_s=args.timeout, token=token,
            on_row=killer.on_row if killer else (lambda row: None),
        )  # fmt: skip
        if killer is not None and killer.thread is not None:
            killer.restarted.wait(300)
            if killer.error is not None:
                raise RuntimeError(f"the server did not start again: {killer.error}")
        written = dep.results(batch.id)
        inflight = list(dep.inflight)
    sent = {w.id for w in work}
    counts = Counter(r["query_id"] for r in written)
    seen = Counter(r["query_id"] for r in results)
    return {
        "results": results,
        "wall_s": wall,
        "tokens": sum(int(r.get("completion_tokens") or 0) for r in results),
        "lost": len(sent - set(counts) | sent - set(seen)),
        "duplicated": sum(n - 1 for n in counts.values()) + sum(n - 1 for n in seen.values()),
        "failed": sum(
            1 for r in results if r.get("error") or r.get("finish_reason") not in ("stop", "length")
        ),
        "kills": killer.kills if killer else 0,
        "inflight": inflight,
    }


def run(args) -> dict:
    if args.num_queries < 1:
        raise ValueError("--num-queries must be >= 1")
    if not 0 < args.kill_at < 1:
        raise ValueError("--kill-at must be in (0, 1)")
    concurrencies = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    if not concurrencies or concurrencies[0] < 1:
        raise ValueError("--concurrency: a comma-separated list of numbers >= 1")
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    server_cpus, client_cpus = _cpus(args.server_cpus), _cpus(args.client_cpus)
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    if pin:
        if server_cpus & client_cpus or not (server_cpus | client_cpus) <= os.sched_getaffinity(0):
            raise ValueError("--server-cpus and --client-cpus must be apart, and cores this process may use")
        pin_threads(os.getpid(), client_cpus)  # the children (Redis, gateway, engine) inherit it
    else:
        log.warning("not pinning: %s", "--no-pin" if args.no_pin else "fewer than two cores")
    from transformers import AutoTokenizer

    model = model_dir(args)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rows, work = batch_rows(args, model, tokenizer)
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    server = EndpointServer(
        model, run_dir, *SERVER_ARGS, *args.server_arg, cpus=sorted(server_cpus) if pin else None
    )
    t0 = time.perf_counter()
    server.start()
    try:
        print(f"server {server.url} (pid {server.proc.pid}, cores {sorted(server_cpus) if pin else 'any'}) "
              f"up in {time.perf_counter() - t0:.1f} s; {len(rows)} rows", file=sys.stderr, flush=True)  # fmt: skip
        warm = warm_up(server.url, rows, 1, 2) + warm_up(server.url, rows, 8, 16)
        print(f"server warmed up in {warm:.1f} s", file=sys.stderr, flush=True)
        fixed = fixed_runs(server.url, rows, concurrencies, not args.no_progress)
        b = gateway_run(args, server, model, work, run_dir, client_cpus if pin else None)
    finally:
        server.stop()
    return summary(args, rows, work, tokenizer, fixed, b, pin)


def summary(args, rows, work, tokenizer, fixed: dict, b: dict, pinned: bool) -> dict:
    from gateway.server import token_counter

    best = max(fixed, key=lambda c: fixed[c]["tokens_per_s"])
    counted = dict(zip([w.id for w in work], token_counter(tokenizer)([w.prompt for w in work]), strict=True))
    served = {r["query_id"]: int(r.get("prompt_tokens") or 0) for r in b["results"]}
    mismatches = sum(1 for q, n in served.items() if counted.get(q) != n)
    direct_mismatches = sum(1 for q, n in fixed[best]["prompt_tokens"].items() if counted.get(q) != n)
    tps = b["tokens"] / b["wall_s"] if b["wall_s"] > 0 else 0.0
    best_tps = fixed[best]["tokens_per_s"]
    out = {
        "command": "endpoints",
        "rows": len(rows),
        "max_tokens": args.max_tokens,
        "kill_server": bool(args.kill_server),
        "pinned": pinned,
        "endpoint_efficiency": round(tps / best_tps, 3) if best_tps > 0 else 0.0,
        "endpoint_tokens_per_s": round(tps, 1),
        "endpoint_wall_s": round(b["wall_s"], 1),
        "endpoint_tokens": b["tokens"],
        "endpoint_inflight_mean": round(sum(b["inflight"]) / len(b["inflight"]), 1) if b["inflight"] else 0.0,
        "endpoint_inflight_max": max(b["inflight"], default=0),
        "best_fixed_concurrency": best,
        "best_fixed_tokens_per_s": round(best_tps, 1),
        "fixed": {str(c): round(f["tokens_per_s"], 1) for c, f in fixed.items()},
        "fixed_tokens": {str(c): f["tokens"] for c, f in fixed.items()},
        "prompt_count_mismatches": mismatches,
        "direct_prompt_count_mismatches": direct_mismatches,
        "lost": b["lost"],
        "duplicated": b["duplicated"],
        "failed": b["failed"],
        "server_kills_survived": b["kills"] if b["lost"] == b["duplicated"] == b["failed"] == 0 else 0,
    }
    out["ok"] = out["lost"] == out["duplicated"] == out["failed"] == 0 and (
        not args.kill_server or out["server_kills_survived"] >= 1
    )
    return out
