"""``fleetbatch engine serve``: its arguments, the engine of the chosen backend, and the worker run until stopped."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from pathlib import Path
from urllib.parse import urlsplit

import torch

from clusterfile import ENDPOINT_BACKEND
from engines.config import EngineConfig
from engines.device import StepCost
from engines.endpoint_backend import EndpointEngine
from engines.endpoint_settings import add_endpoint_arguments
from engines.engine import LLMEngine
from engines.interface import Engine
from engines.metrics import serve_metrics
from engines.model_runner import resolve_device
from engines.pipeline import StageFailure
from engines.plan import plan_stages
from engines.static_engine import StaticBatchEngine
from engines.vllm_args import DefaultCount, add_vllm_arguments
from engines.vllm_engine import VLLMEngine
from engines.worker import Worker, WorkerConfig
from localmodels import load_or_build
from workqueue import WorkQueue, connect
from workqueue.embedded import URL_ENV
from workqueue.length_stats import directory_key, length_model_key
from workqueue.openai_body import PASS_THROUGH

log = logging.getLogger(__name__)

#: ``--device-cost plan``: each stage emulates its plan device by the device's cost model
PLAN_COST = "plan"

DEVICE_HELP = (
    "where the native engine computes: cpu (default), cuda or cuda:N; a CUDA device that is not there "
    "is an error, never a silent fallback to the CPU (the vllm backend picks its GPU itself)"
)


def add_prefix_cache_argument(p) -> None:
    """``--no-prefix-cache`` (``fleetbatch engine serve``, ``generate`` and ``bench``): the cache is on by default."""
    p.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="turn the prefix cache off (default on: queries reuse the cached KV of a shared prompt prefix; "
        "the vllm backend: its enable_prefix_caching)",
    )


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, help="cluster name (its Redis queue is {fb}:c:NAME:queue)")
    p.add_argument("--redis-url", default=None, help=f"Redis URL (default: ${URL_ENV})")
    p.add_argument(
        "--backend",
        choices=("native", "static", "vllm", ENDPOINT_BACKEND),
        default="native",
        help="native: iteration-level engine; static: HF generate on padded batches; vllm: GPU only; "
        "endpoint: send the queries to OpenAI-compatible servers already running (--endpoint-url)",
    )
    p.add_argument(
        "--served-model", default=None, help="local Hugging Face model directory (default: a random model)"
    )
    p.add_argument(
        "--arch", default="llama", choices=("llama", "gpt2", "opt"), help="architecture of the random model"
    )
    p.add_argument("--size", default="tiny", help="size of the random model: nano, micro, tiny, small, base")
    p.add_argument(
        "--length-model",
        default=None,
        help="the name the gateway keeps this cluster's answer lengths under, to calibrate the length predictor "
        "to its model (default: the --served-model directory's name and a digest of its config and tokenizer; "
        "for endpoints --served-model-name or their URL's host; for a random model random-ARCH-SIZE). Clusters "
        "serving one model should give one name; 'none' keeps nothing",
    )
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument(
        "--plan",
        default=None,
        help="plan.json from `fleetbatch planner plan` (layer bits, micro-batch sizes)",
    )
    p.add_argument(
        "--rendezvous",
        default=None,
        help="torch.distributed rendezvous of a multi-stage plan's stage processes, tcp://HOST:PORT "
        "(default: a free port on 127.0.0.1)",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=DefaultCount(8),
        help="most queries running at once (the vllm backend: vLLM's own max_num_seqs unless given, or "
        "the plan's batch size)",
    )
    p.add_argument(
        "--kv-budget-tokens",
        type=int,
        default=None,
        help="KV cache size in tokens of the native engine (default: its config's, 16384)",
    )
    add_prefix_cache_argument(p)
    p.add_argument(
        "--capacity", type=float, default=0.0, help="capacity hint in tokens/s (default: measured)"
    )
    p.add_argument(
        "--slowdown",
        type=float,
        default=0.0,
        help="emulate a device this many times slower than this CPU: each step lasts (1 + SLOWDOWN) x its "
        "compute (CPU) time, so contention on a shared CPU does not change the emulated device",
    )
    p.add_argument(
        "--device-cost",
        default=None,
        metavar="OVERHEAD,PREFILL,DECODE|plan",
        help="emulate a device by a cost model instead: each step lasts what its forward passes cost, "
        "OVERHEAD ms per pass + PREFILL ms per prompt token + DECODE ms per decoded query (e.g. 8,0.05,0.5), "
        "divided by --device-speed; the same charge for the static and native backends "
        "(docs/design/study.md). 'plan' (native backend, with --plan): every stage of the plan makes each "
        "micro-batch last what its plan device's cost model charges for its layers at their bits, the "
        "micro-batch's prompt chunks and decode contexts and its share of the LM head; every device "
        "of the plan must carry a 'cost' (docs/design/engine.md). Either way a step (micro-batch) whose "
        "compute takes longer lasts its compute and is counted as an overrun",
    )
    p.add_argument(
        "--device-speed",
        type=float,
        default=1.0,
        help="with --device-cost: the device's speed (0.5: every pass takes twice as long)",
    )
    p.add_argument(
        "--lease-s", type=float, default=15.0, help="lease of a claimed query; renewed while it runs"
    )
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="heartbeat period")
    p.add_argument(
        "--grace-s",
        type=float,
        default=0.0,
        help="SIGTERM is a preemption notice of this many seconds (Kubernetes' grace period): claim nothing more, "
        "finish the queries that end within it, checkpoint and give back the others (default 0: SIGTERM stops now)",
    )
    p.add_argument(
        "--checkpoint-tokens",
        type=int,
        default=64,
        help="write each running query's partial output every this many tokens, so a hard kill loses at most "
        "that many (native and vllm backends; the endpoint backend writes its streams' text as often, at most "
        "a tick behind; 0: only under a notice)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics here (per pipeline stage: compute, idle, emulated time, memory, "
        "measured and plan-predicted decode latency)",
    )
    p.add_argument("--max-queries", type=int, default=None, help="exit after this many queries (tests)")
    add_endpoint_arguments(p)
    add_vllm_arguments(p)


def served_model_name(args: argparse.Namespace) -> str:
    """The name rows may give the cluster's model: the endpoints' (``--served-model-name``), a local
    directory's own name, or "" (a random model, or endpoints not named: any name is taken)."""
    if args.backend == ENDPOINT_BACKEND:
        return args.served_model_name or ""
    return Path(args.served_model).name if args.served_model else ""


def length_model(args: argparse.Namespace) -> str:
    """The key this cluster's answer lengths are kept under (``--length-model``; :mod:`workqueue.length_stats`)."""
    if args.length_model:
        return "" if args.length_model == "none" else length_model_key(args.length_model)
    if args.backend == ENDPOINT_BACKEND:
        named = args.served_model_name or urlsplit((args.endpoint_url or [""])[0]).hostname or "endpoint"
        return length_model_key(named.replace(":", "-"))
    if args.served_model:
        return directory_key(args.served_model)
    return f"random-{args.arch}-{args.size}"


def openai_fields(args: argparse.Namespace) -> frozenset[str]:
    """The OpenAI fields the cluster passes through (``--endpoint-fields``; only endpoints honour any)."""
    if args.backend != ENDPOINT_BACKEND:
        return frozenset()
    raw = (args.endpoint_fields or "all").strip()
    if raw == "all":
        return PASS_THROUGH
    named = frozenset(f.strip() for f in raw.split(",") if f.strip() and f.strip() != "none")
    unknown = sorted(named - PASS_THROUGH)
    if unknown:
        raise ValueError(
            f"--endpoint-fields: {', '.join(unknown)} cannot be passed through "
            f"(known: {', '.join(sorted(PASS_THROUGH))})"
        )
    return named


def build_engine(args: argparse.Namespace) -> Engine:
    """The engine for ``args.backend``, with its model."""
    if args.backend == ENDPOINT_BACKEND:
        return EndpointEngine.from_args(args)
    if args.backend == "vllm":
        return VLLMEngine.from_args(args)
    if args.backend == "native":
        config = EngineConfig(
            max_running=args.max_running, device=args.device, prefix_cache=args.prefix_cache
        )
        if args.kv_budget_tokens is not None:
            config.kv_budget_tokens = args.kv_budget_tokens
            config.validate()
        if args.plan:
            config.plan_path = args.plan
            config.pipeline.init_method = args.rendezvous
            config.pipeline.emulate_cost = args.device_cost == PLAN_COST
        return LLMEngine.from_pretrained(args.served_model, arch=args.arch, size=args.size, config=config)
    if args.device != "cpu":
        raise ValueError(f"the static backend runs on the CPU only, not on --device {args.device}")
    model, tokenizer = load_or_build(args.served_model, arch=args.arch, size=args.size)
    return StaticBatchEngine(model, tokenizer, max_batch=args.max_running)


def parse_device_cost(args: argparse.Namespace) -> StepCost | None:
    """The worker's cost-model device of a numeric ``--device-cost``; None for ``plan``, whose stages
    emulate their plan devices themselves (checked here: each must carry a cost). A ValueError
    says what is wrong with the combination of flags."""
    if args.slowdown:
        raise ValueError("--device-cost and --slowdown are two ways to emulate a device: pass one")
    if args.device_cost == PLAN_COST:
        if not args.plan:
            raise ValueError("'plan' emulates the devices of a plan: pass --plan PLAN.json")
        if args.backend != "native":
            raise ValueError(f"'plan' emulates the native engine's stages, not the {args.backend} backend")
        if args.device_speed != 1.0:
            raise ValueError("--device-speed scales a numeric cost; a plan's devices carry their own")
        stages = plan_stages(args.plan)
        for stage in stages:
            stage.emulated(len(stages), 0.0)  # a device without a cost, or without its layers' bits
        log.info("emulated devices: each plan stage's by its device's cost model")
        return None
    if args.backend in ("vllm", ENDPOINT_BACKEND):
        raise ValueError(f"it emulates one-process native or static engines, not {args.backend}")
    if args.plan:
        raise ValueError(
            "a numeric cost emulates one process; with --plan pass '--device-cost plan' to emulate each "
            "stage by its plan device's cost model"
        )
    cost = StepCost.parse(args.device_cost, speed=args.device_speed)
    log.info("emulated device: %s", cost.describe())
    return cost


def run_serve(args: argparse.Namespace) -> int:
    url = args.redis_url or os.environ.get(URL_ENV)
    if not url:
        log.error(
            "no Redis URL: pass --redis-url or set $%s (`fleetbatch gateway up` sets it for its engines)",
            URL_ENV,
        )
        return 1
    if args.max_running < 1:
        log.error("--max-running must be >= 1")
        return 1
    if args.vllm_arg and args.backend != "vllm":
        log.error("--vllm-arg sets engine arguments of vLLM: it needs --backend vllm")
        return 1
    if args.backend == ENDPOINT_BACKEND and (args.slowdown or args.plan):
        log.error("the endpoint backend's servers are real: --slowdown and --plan do not apply to them")
        return 1
    try:
        fields = openai_fields(args)
        if args.backend != "vllm":
            resolve_device(args.device)
    except ValueError as e:
        log.error("%s", e)
        return 1
    device_cost = None
    if args.device_cost is not None:
        try:
            device_cost = parse_device_cost(args)
        except (ValueError, OSError) as e:
            log.error("--device-cost: %s", e)
            return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        queue = WorkQueue(connect(url))
    except ConnectionError as e:
        log.error("%s", e)
        return 1
    try:
        engine = build_engine(args)
    except (FileNotFoundError, ValueError, ImportError) as e:
        log.error("cannot build the %s engine: %s", args.backend, e)
        return 1
    except StageFailure as e:  # a stage process of the plan did not start (its message names it)
        log.error("cannot start the engine's pipeline: %s", e)
        return 1
    config = WorkerConfig(
        cluster=args.cluster,
        lease_s=args.lease_s,
        heartbeat_s=args.heartbeat_s,
        backend=args.backend,
        served_model=served_model_name(args),
        length_model=length_model(args),
        openai_fields=fields,
        capacity_hint_tps=args.capacity,
        slowdown=args.slowdown,
        device_cost=device_cost,
        checkpoint_tokens=max(0, args.checkpoint_tokens),
    )
    worker = Worker(queue, engine, config)
    if args.grace_s > 0:
        signal.signal(signal.SIGTERM, lambda *_: worker.notice(args.grace_s))
    else:
        signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())
    try:
        if args.metrics_port is not None:
            serve_metrics(engine, args.metrics_port, worker=worker)
            log.info("Prometheus metrics on :%d/metrics", args.metrics_port)
        worker.run(max_queries=args.max_queries)
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    if worker.failure:
        log.error("worker stopped: %s", worker.failure)
        return 1
    return 0
