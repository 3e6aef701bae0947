"""Check C of the GPU check: the endpoint backend in front of a real ``transformers serve`` on the device.

``python -m engines.bench.gpu_check_endpoint --workdir D --device cuda [--workload JSON]`` (started by
:mod:`engines.bench.gpu_check` with a time limit):

1. builds a small chat model in ``D/chat-model`` (:func:`localmodels.chat_model.build_chat_model`: a
   random Llama with a tokenizer whose chat template writes a BOS and turn tokens);
2. starts ``transformers serve D/chat-model --device DEVICE`` as a process on a free loopback port
   (run as ``python -m transformers.cli.transformers``, so no console script is needed) and waits
   for ``/health``; the server is killed by its pid at the end, whatever happens;
3. drives :class:`engines.endpoint_backend.EndpointEngine` in this process with one warm-up and then
   ``queries`` chat requests of at most ``gen_len`` tokens, greedy (the flow control finds its own
   concurrency, as in a deployment), and reports completion tokens/s;
4. counts ``prompt_count_mismatches``: rows whose ``usage.prompt_tokens`` (the server's count) is not
   the expected count. The gateway's code cannot be imported from ``engines``: the expected count is
   the length of the tokenizer's ``apply_chat_template(messages, add_generation_prompt=True,
   tokenize=True)``, which is what :mod:`localmodels.prompt_ids`'s rule gives for a chat rendered by
   a template that writes its own BOS (no second BOS), the gateway's rule.

The module's top imports only the standard library: :mod:`engines.bench.gpu_check` imports it to probe
(:func:`missing`) and to launch every check (:func:`launch`) before it knows what the machine has.
Packages missing on the GPU machine (which has no package index) may be carried in the working
tree as a directory made by ``pip install --target`` (default ``build/gpu-check-site``, or
``$FLEETBATCH_GPU_CHECK_SITE``): :func:`launch` adds it at the *end* of ``sys.path`` of every check's
process and of the server, so it only fills gaps and never shadows what the machine has.
The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

log = logging.getLogger("gpu-check")

#: a directory of packages carried in the working tree (``pip install --target``), appended to sys.path
SITE_ENV = "FLEETBATCH_GPU_CHECK_SITE"
SERVE_WHEN_READY = "serve-when-ready"  # this module's other command: the server (serve_when_ready)
DEFAULT_SITE = Path(__file__).resolve().parents[2] / "build" / "gpu-check-site"
#: what check C imports beyond check A's: ``transformers serve`` (the ``serving`` extra, and typer for
#: transformers' command line) and the endpoint backend (httpx; yaml and pydantic through clusterfile)
NEEDS = ("fastapi", "uvicorn", "starlette", "pydantic", "openai", "typer", "httpx", "yaml")
#: how the expected prompt tokens of a chat are counted (the JSON says it)
PROMPT_COUNT_RULE = (
    "len(apply_chat_template(messages, add_generation_prompt=True, tokenize=True)): the rule of "
    "localmodels.prompt_ids, as the gateway counts"
)
#: run a module as ``python -m`` would, with the carried site (if any) appended to sys.path first
_LAUNCH = (
    "import os, runpy, site, sys\n"
    f"d = os.environ.get({SITE_ENV!r})\n"
    "if d and os.path.isdir(d):\n"
    "    site.addsitedir(d)\n"
    "m = sys.argv[1]\n"
    "sys.argv = [m, *sys.argv[2:]]\n"
    "runpy.run_module(m, run_name='__main__', alter_sys=True)\n"
)


def carried_site() -> Path | None:
    """The carried package directory, when there is one (``$FLEETBATCH_GPU_CHECK_SITE`` or the default)."""
    d = Path(os.environ.get(SITE_ENV) or DEFAULT_SITE)
    return d if d.is_dir() else None


def launch(module: str, *args: str) -> list[str]:
    """The command that runs ``module`` as ``python -m module args`` with the carried site appended."""
    return [sys.executable, "-c", _LAUNCH, module, *args]


def missing() -> list[str]:
    """Which of :data:`NEEDS` cannot be imported here (looked up, not imported)."""
    return [p for p in NEEDS if importlib.util.find_spec(p) is None]


# ---------------------------------------------------------------- the server (as load.endpoint_server)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def serve_command(model_dir: Path, port: int, device: str, extra: list[str], wait_s: float) -> list[str]:
    """``transformers serve MODEL_DIR ...`` by :func:`serve_when_ready`: it may start before the model is built."""
    args = [
        "--host", "127.0.0.1", "--port", str(port), "--device", device, "--dtype", "float32",
        "--log-level", "warning", *extra,
    ]  # fmt: skip
    return launch("engines.bench.gpu_check_endpoint", SERVE_WHEN_READY, str(model_dir), str(wait_s), *args)


def serve_when_ready(model_dir: str, wait_s: float, args: list[str]) -> None:
    """Import ``transformers serve`` (seconds of imports, while the check builds the model), wait for the
    model directory (``build_chat_model`` renames it into place whole), then serve it."""
    from transformers.cli.transformers import main as transformers_main

    deadline = time.monotonic() + wait_s
    while not (Path(model_dir) / "config.json").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no model at {model_dir} after {wait_s:.0f} s")
        time.sleep(0.05)
    sys.argv = ["transformers", "serve", model_dir, *args]
    transformers_main()


def start_server(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """Start the server (killed by its pid by the caller, see :func:`kill`)."""
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
        TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
    )  # fmt: skip
    with open(log_path, "ab") as out:
        # in the check's process group: a check killed for its time limit (os.killpg) takes the server along
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def wait_healthy(proc: subprocess.Popen, log_path: Path, health: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not answers(health):
        if proc.poll() is not None:
            raise RuntimeError(f"transformers serve exited ({proc.returncode}): {tail(log_path)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"transformers serve did not answer in {timeout_s:.0f} s: {tail(log_path)}")
        time.sleep(0.2)


def kill(proc: subprocess.Popen | None) -> None:
    """SIGKILL the server by its pid and reap it."""
    if proc is None:
        return
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# ---------------------------------------------------------------- the requests


def chats(n: int, words: int = 24) -> list[list[dict[str, str]]]:
    """``n`` chats (a system turn, a user turn of generated text) that differ from one another."""
    from localmodels import generated_corpus

    texts = generated_corpus(n, seed=11)
    return [
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": f"Question {i}: " + " ".join(t.split()[:words])},
        ]
        for i, t in enumerate(texts)
    ]


def expected_prompt_tokens(tokenizer, messages: list[dict[str, str]]) -> int:
    """The prompt tokens of a chat as the gateway counts them (see the module's docstring)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # a BatchEncoding (transformers 5 returns a dict by default)
        ids = ids["input_ids"]
    return len(ids)


def drive(engine, requests: list, timeout_s: float) -> dict[str, Any]:
    """Hand ``requests`` to ``engine`` and step it until all finish; their outputs by request id."""
    for r in requests:
        engine.add_request(r)
    outs: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(requests) - len(outs)} requests unfinished after {timeout_s:.0f} s")
        for o in engine.step():
            outs[o.request_id] = o
    return outs


def run(workdir: Path, device: str, w: dict[str, Any], serve_args: list[str], start_timeout_s: float):
    """Check C (see the module's docstring); the server is killed in any case."""
    n, k = w["queries"], w["gen_len"]
    out: dict[str, Any] = {"device": device, "model_size": w["size"], "serve_args": serve_args}
    model_dir, port = workdir / "chat-model", free_port()
    url, log_path = f"http://127.0.0.1:{port}/v1", workdir / "transformers-serve.log"
    t0 = time.perf_counter()
    log.info("endpoint: transformers serve on %s, port %d (importing while the model is built)", device, port)
    proc = start_server(serve_command(model_dir, port, device, serve_args, start_timeout_s), log_path)
    engine = None
    try:
        from localmodels.chat_model import build_chat_model

        build_chat_model(model_dir, size=w["size"])
        out["build_s"] = round(time.perf_counter() - t0, 2)
        from transformers import AutoTokenizer

        from engines.endpoint_backend import EndpointEngine
        from engines.endpoint_flow import FlowSettings
        from engines.endpoint_settings import EndpointSettings
        from engines.interface import Request, SamplingParams

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        wait_healthy(proc, log_path, f"http://127.0.0.1:{port}/health", start_timeout_s)
        out["server_ready_s"] = round(time.perf_counter() - t0, 2)
        flow = FlowSettings(initial_limit=min(2.0, n), max_limit=max(1, min(16, n)))
        settings = EndpointSettings(urls=(url,), model=str(model_dir), give_up_s=60.0, flow=flow)
        engine = EndpointEngine(settings)
        convs = chats(n + 1)
        reqs = [
            Request(f"e{i}", "", SamplingParams(max_tokens=k, temperature=0.0), openai_body={"messages": m})
            for i, m in enumerate(convs)
        ]
        log.info("endpoint: warm-up, then %d chat requests of at most %d tokens", n, k)
        warm = drive(engine, reqs[:1], start_timeout_s)
        t0 = time.perf_counter()
        outs = {**drive(engine, reqs[1:], start_timeout_s), **warm}
        wall = time.perf_counter() - t0
    finally:
        if engine is not None:
            engine.close()
        kill(proc)
    timed = [outs[r.request_id] for r in reqs[1:]]
    expected = {r.request_id: expected_prompt_tokens(tok, m) for r, m in zip(reqs, convs, strict=True)}
    errors = [
        f"{o.request_id}: {o.finish_reason} {o.error}".strip()
        for o in outs.values()
        if o.error or o.finish_reason in ("error", "abort")
    ]
    mismatched = sorted(rid for rid, o in outs.items() if o.prompt_tokens != expected[rid])
    tokens = sum(o.completion_tokens for o in timed)
    out.update(
        status="failed" if errors or mismatched or tokens == 0 else "ran",
        requests=len(timed),
        completion_tokens=tokens,
        prompt_tokens=sum(o.prompt_tokens for o in timed),
        wall_s=round(wall, 3),
        tokens_per_s=round(tokens / wall, 1) if wall > 0 else None,
        finish_reasons={
            r: sum(o.finish_reason == r for o in timed) for r in sorted({o.finish_reason for o in timed})
        },
        prompt_count_mismatches=len(mismatched),
        prompt_count_rule=PROMPT_COUNT_RULE,
        errors=errors[:5],
    )
    if mismatched:
        rid = mismatched[0]
        out["first_mismatch"] = {"request": rid, "server": outs[rid].prompt_tokens, "expected": expected[rid]}
    if tokens == 0 and not errors:
        out["errors"] = ["no completion tokens"]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [SERVE_WHEN_READY]:  # the server's process (serve_command)
        serve_when_ready(argv[1], float(argv[2]), argv[3:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--workload", default="{}", help="Workload fields as JSON (size, queries, gen_len)")
    p.add_argument("--serve-arg", action="append", default=[], help="an argument for transformers serve")
    p.add_argument("--start-timeout-s", type=float, default=120.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gpu-check: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    w = {"size": "small", "queries": 64, "gen_len": 64, **json.loads(args.workload)}
    try:
        out = run(Path(args.workdir), args.device, w, args.serve_arg, args.start_timeout_s)
    except Exception as e:  # reported in the JSON: the check's job is to say what broke
        log.exception("endpoint check failed")
        out = {"status": "failed", "device": args.device, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
