"""``fleetbatch engine profile``: time the engine's own decoder layer and LM head, and write a fleetbatch planner profile.

The planner fits its latency model to a profile (``profile.json``, version 1: ``device``,
``model``, ``source``, ``meta`` and ``samples[bits]`` with ``prefill`` ``[v, s, seconds]``,
``decode`` ``[v, c, seconds]``, ``head`` ``[v, 0, seconds]`` and ``driver`` ``[v, 0, seconds]`` rows:
the last is the engine's own work per decode micro-batch of ``v`` queries besides the model,
which the first pipeline stage's process does). ``fleetbatch planner profile``
times a Hugging Face layer; this one times what the engine really runs: one layer of
:class:`~engines.model_runner.ModelRunner` over a :class:`~engines.step_batch.StepBatch` with
the paged KV cache (gathered context, masked attention), so a plan made from it predicts the
engine's stages. Every point is warmed up, timed in shuffled rounds, each timing repeated for
``min_time_s`` and the fastest call kept, and each point keeps its minimum over the rounds, on
the thread's CPU clock with one thread (blind to time slices taken by other processes). Before
every call the caches are evicted (a pass over ``flush_bytes``): a running engine streams each
layer's weights and KV once per micro-batch, so a layer that stays in cache between calls would
be timed faster than it runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from engines.config import EngineConfig
from engines.interface import SamplingParams
from engines.kv_cache import KVCacheManager
from engines.model_runner import ModelRunner, make_adapter
from engines.scheduler import Scheduler
from engines.sequence import Sequence
from engines.stage_model import hidden_size
from engines.stage_wire import STEP, pack
from engines.step_batch import ChunkLayout, StepBatch
from localmodels import load_or_build
from quant.apply import apply_bitmap

PROFILE_VERSION = 1


def model_entry(model: nn.Module, name: str) -> dict:
    """The ``model`` entry of a profile or plan: the shape the planner checks against."""
    cfg, a = model.config, make_adapter(model)
    hidden = hidden_size(model)
    inter = (
        getattr(cfg, "intermediate_size", None)
        or getattr(cfg, "ffn_dim", None)
        or getattr(cfg, "n_inner", None)
    )
    return {
        "name": name,
        "hidden": hidden,
        "layers": a.num_layers,
        "heads": a.num_heads,
        "kv_heads": a.num_kv_heads,
        "intermediate": int(inter or 4 * hidden),
        "vocab": int(cfg.vocab_size),
    }


def _batch(v: int, start: int, n: int, block_size: int) -> StepBatch:
    """``v`` queries, each computing ``n`` tokens from position ``start``, on disjoint blocks."""
    per = -(-(start + n) // block_size)
    chunks = [ChunkLayout(start, n, True, tuple(range(q * per, (q + 1) * per))) for q in range(v)]
    return StepBatch(chunks, block_size, [1] * (v * n))


def _fastest(fn: Callable[[], object], min_time_s: float, flush: torch.Tensor | None = None) -> float:
    """The fastest of repeated calls (until ``min_time_s`` of them), each after evicting the caches."""
    best, spent = math.inf, 0.0
    while spent < min_time_s or best == math.inf:
        if flush is not None:
            flush.add_(1)  # a running engine streams every layer's weights and KV: none stay in cache
        t0 = time.thread_time()
        fn()
        dt = time.thread_time() - t0
        best, spent = min(best, dt), spent + dt
    return best


def driver_call(v: int, context: int, block_size: int, hidden: int) -> Callable[[], object]:
    """One decode micro-batch of the driver's own work besides the model, for ``v`` queries of
    ``context`` tokens: the real scheduler picks them, their :class:`StepBatch` and its message to
    the next stage are built, and their sampled tokens are applied. The first pipeline stage's
    process does this on top of its layers (``planner.head_split`` balances it)."""
    room = 1 << 15  # tokens each query may still grow by while it is timed (one per call)
    total = v * (context + room + block_size)
    cfg = EngineConfig(
        kv_budget_tokens=total,
        block_size=block_size,
        max_running=v,
        max_batch_tokens=v * context,
        prefill_chunk=context,
        safety_margin=0.0,  # every one of the v queries is admitted
    )
    kv = KVCacheManager(total // block_size, block_size)
    sched = Scheduler(cfg, kv)
    for q in range(v):
        sp = SamplingParams(max_tokens=room, forced_length=room)
        sched.add(Sequence(f"p{q}", [1] * (context - 1), sp, predicted_tokens=room))

    def step() -> None:
        out = sched.schedule()
        batch = StepBatch.from_chunks(out.chunks, block_size)
        pack(STEP, batch.to_tensor(), trailer, h[: len(out.chunks)])
        sampled = [c.seq for c in out.chunks if c.samples]
        sched.update_from_output(out, sampled, [1] * len(sampled), 0.0)

    trailer = torch.zeros(2, 8, dtype=torch.float64)
    h = torch.zeros(v, hidden)
    step()  # the prompts' prefill: every query decodes from here on
    if len(sched.running) != v:
        raise RuntimeError(f"the driver profile admitted {len(sched.running)} of {v} queries")
    return step


def profile_engine(
    model: nn.Module,
    name: str,
    decode_batches: tuple[int, ...] = (1, 8, 16, 32, 64),
    lengths: tuple[int, ...] = (64, 128, 256),
    prefill_batches: tuple[int, ...] = (1, 2, 4),
    bits: tuple[int, ...] = (16,),
    reps: int = 3,
    min_time_s: float = 0.05,
    block_size: int = 16,
    progress: bool = True,
    seed: int = 0,
    flush_bytes: int = 64 << 20,
) -> dict:
    """Measured profile of layer 0 and the LM head of ``model`` as the engine runs them (one thread)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    hidden = model_entry(model, name)["hidden"]
    top = max(max(decode_batches), max(prefill_batches)) * -(-(max(lengths) + 1) // block_size)
    points: list[tuple[int, str, int, int]] = []
    for b in bits:
        points += [(b, "prefill", v, s) for v in prefill_batches for s in lengths]
        points += [(b, "decode", v, c) for v in decode_batches for c in lengths]
        if b == 16:
            points += [(b, "head", v, 0) for v in decode_batches]
            points += [(b, "driver", v, 0) for v in decode_batches]
    runners = {}
    for b in bits:
        m = model
        if b != 16:
            m = apply_bitmap(copy.deepcopy(model), {0: b})
        runners[b] = ModelRunner(m, top, block_size, 16, range(0, 1))
    calls: dict = {}
    for p in points:
        b, phase, v, x = p
        r = runners[b]
        if phase == "driver":
            calls[p] = driver_call(v, max(lengths), block_size, hidden)
            continue
        batch = _batch(v, 0, x, block_size) if phase == "prefill" else _batch(v, x, 1, block_size)
        h = torch.randn(batch.num_tokens, hidden, dtype=r.dtype)
        call = (
            (lambda r=r, h=h, batch=batch: r.logits(h, batch))
            if phase == "head"
            else (lambda r=r, h=h, batch=batch: r.forward(h, batch))
        )
        calls[p] = call
    times: dict = {p: [] for p in points}
    flush = torch.zeros(flush_bytes // 4) if flush_bytes else None
    rng = random.Random(seed)
    wall0 = time.perf_counter()
    try:
        with (
            torch.inference_mode(),
            tqdm(total=len(points) * reps, desc="profiling", disable=not progress) as bar,
        ):
            for p in points:
                calls[p]()  # warm-up
            for _ in range(reps):
                order = points.copy()
                rng.shuffle(order)
                for p in order:
                    times[p].append(_fastest(calls[p], min_time_s, flush))
                    bar.update()
    finally:
        torch.set_num_threads(prev)
    samples: dict[str, dict[str, list]] = {}
    for p, ts in times.items():
        b, phase, v, x = p
        samples.setdefault(str(b), {}).setdefault(phase, []).append([v, x, min(ts)])
    return {
        "version": PROFILE_VERSION,
        "device": "CPU",
        "model": model_entry(model, name),
        "source": "measured (engine)",
        "meta": {
            "what": "engines.model_runner layer 0 (paged KV) and LM head, StepBatch inputs; the driver's scheduling",
            "threads": 1,
            "clock": "thread",
            "reps": reps,
            "min_time_s": min_time_s,
            "block_size": block_size,
            "statistic": "min over rounds of the fastest call",
            "cold_cache_bytes": flush_bytes,
            "wall_s": round(time.perf_counter() - wall0, 2),
            "torch": torch.__version__,
        },
        "samples": samples,
    }


def merge_profiles(docs: list[dict]) -> dict:
    """One profile from several taken at the same time: each point's mean over them."""
    out = copy.deepcopy(docs[0])
    for bits, phases in out["samples"].items():
        for phase, rows in phases.items():
            for i, row in enumerate(rows):
                row[2] = sum(d["samples"][bits][phase][i][2] for d in docs) / len(docs)
    out["meta"]["concurrent"] = len(docs)
    out["meta"]["wall_s"] = max(d["meta"]["wall_s"] for d in docs)
    return out


# ---- `fleetbatch engine profile` ----------------------------------------------------------------


def _profile_concurrently(args: argparse.Namespace) -> int:
    """``--concurrent N``: N profilers at once (as N stages share this machine's memory system); the mean."""
    base = [sys.executable, "-m", "engines.cli", "profile", "--arch", args.arch, "--size", args.size]
    base += ["--batches", args.batches, "--lengths", args.lengths, "--prefill-batches", args.prefill_batches]
    base += ["--bits", args.bits, "--reps", str(args.reps), "--min-time", str(args.min_time)]
    if args.served_model:
        base += ["--served-model", args.served_model]
    with tempfile.TemporaryDirectory(prefix="fleetbatch-profile-") as tmp:
        outs = [f"{tmp}/p{k}.json" for k in range(args.concurrent)]
        logs = [Path(f"{o}.log") for o in outs]
        procs = []
        for o, log_file in zip(outs, logs, strict=True):
            with open(log_file, "wb") as err:  # a file, not a pipe: a child never waits on a full pipe
                procs.append(subprocess.Popen([*base, "--out", o], stdout=subprocess.DEVNULL, stderr=err))
        for p, log_file in zip(procs, logs, strict=True):
            if p.wait() != 0:
                tail = log_file.read_text(errors="replace").strip()[-500:]
                raise ValueError(f"a concurrent profiler failed: {tail}")
        doc = merge_profiles([json.loads(Path(o).read_text()) for o in outs])
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({"profile": args.out, "model": doc["model"]["name"], **doc["meta"]}))
    return 0


def run_profile(args: argparse.Namespace) -> int:
    def ints(text: str, what: str) -> tuple[int, ...]:
        try:
            vals = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
        except ValueError:
            raise ValueError(f"--{what} must be comma-separated integers, got {text!r}") from None
        if not vals or min(vals) < 1:
            raise ValueError(f"--{what} must list positive integers, got {text!r}")
        return vals

    bits = ints(args.bits, "bits")
    if set(bits) - {2, 3, 4, 8, 16}:
        raise ValueError(f"--bits must be among 2,3,4,8,16, got {args.bits!r}")
    if args.concurrent < 1:
        raise ValueError(f"--concurrent must be >= 1, got {args.concurrent}")
    if args.concurrent > 1:
        return _profile_concurrently(args)
    model, _ = load_or_build(args.served_model, arch=args.arch, size=args.size)
    name = args.served_model or f"{args.arch}:{args.size}"
    doc = profile_engine(
        model,
        name,
        ints(args.batches, "batches"),
        ints(args.lengths, "lengths"),
        ints(args.prefill_batches, "prefill-batches"),
        bits,
        reps=args.reps,
        min_time_s=args.min_time,
    )
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({"profile": args.out, "model": name, **doc["meta"]}))
    return 0
