"""Time one real decoder layer and the LM head on the local device over a (batch x length) grid; write a profile.

The layer is a one-layer Hugging Face model of the given shape with random weights (no
embeddings or LM head in the timing: ``inputs_embeds`` in, hidden states out). Prefill times
a forward over ``v x s`` tokens; decode times one new token per sequence on a cache already
holding ``c`` tokens (the cache is cropped back after each step). The LM head (the final norm
and the ``hidden -> vocab`` projection, ``lm_head_module``) is timed on ``v`` tokens for every
decode batch size ``v``. Each point is the minimum over rounds of a grid timed several times in
shuffled order; the minimum is the figure least disturbed by other processes on a shared machine. One thread and the thread's CPU time as the
clock by default, for the same reason (see ``profile_local``).
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
from collections.abc import Iterable

import torch
from tqdm import tqdm

from planner.catalog import local_cpu
from planner.latency import Profile
from planner.modelshape import ModelShape

log = logging.getLogger(__name__)

PREFILL_BATCHES = (1, 2, 4, 8)
PREFILL_LENGTHS = (128, 256, 512, 1024)
DECODE_BATCHES = (1, 2, 4, 8)
DECODE_CONTEXTS = (128, 256, 512, 1024)


def one_layer_model(shape: ModelShape, dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModel

    hf = shape.hf_config()
    cfg = hf.__class__(**{**hf.to_dict(), "num_hidden_layers": 1, "n_layer": 1})
    if hasattr(cfg, "num_hidden_layers"):
        cfg.num_hidden_layers = 1
    torch.manual_seed(seed)
    return AutoModel.from_config(cfg).to(device=device, dtype=dtype).eval()


def lm_head_module(shape: ModelShape, dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    """The last stage's head: the final norm (RMSNorm for Llama, LayerNorm otherwise) and
    ``Linear(hidden, vocab, bias=False)``, random weights."""
    torch.manual_seed(seed)
    norm = torch.nn.RMSNorm(shape.hidden) if shape.family == "llama" else torch.nn.LayerNorm(shape.hidden)
    head = torch.nn.Linear(shape.hidden, shape.vocab, bias=False)
    return torch.nn.Sequential(norm, head).to(device=device, dtype=dtype).eval()


CLOCKS = ("thread", "process", "wall")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def default_clock(device: str, threads: int | None) -> str:
    """``thread`` (CPU time of this thread) for a one-thread CPU profile, else ``wall``.

    With one intra-op thread every kernel runs on the calling thread, so its CPU time is the
    layer's compute time without the time the scheduler gave to other jobs on a shared machine.
    With more threads the work is spread over torch's pool and only wall time (or process time,
    which sums the threads) is meaningful; GPU work is invisible to CPU clocks.
    """
    return "thread" if device == "cpu" and threads == 1 else "wall"


def clock_fn(clock: str):
    if clock not in CLOCKS:
        raise ValueError(f"unknown clock {clock!r}; choose one of {', '.join(CLOCKS)}")
    return {"thread": time.thread_time, "process": time.process_time, "wall": time.perf_counter}[clock]


def _measure(run, device: str, clock, min_s: float, max_runs: int = 200) -> float:
    """Seconds of the fastest of repeated calls of ``run()`` (repeated until ``min_s`` of clock time
    have passed): the least disturbed single call, as ``timeit`` recommends."""
    n, total, best = 0, 0.0, math.inf
    while n < 1 or (total < min_s and n < max_runs):
        _sync(device)
        t0 = clock()
        run()
        _sync(device)
        dt = clock() - t0
        total += dt
        best = min(best, dt)
        n += 1
    return best


def _prefill_runner(model, hidden: int, v: int, s: int, dtype, device: str):
    x = torch.randn(v, s, hidden, dtype=dtype, device=device)

    def run() -> None:
        model(inputs_embeds=x, use_cache=False)

    return run, None


def _decode_runner(model, hidden: int, v: int, c: int, dtype, device: str):
    cache = model(
        inputs_embeds=torch.randn(v, c, hidden, dtype=dtype, device=device), use_cache=True
    ).past_key_values
    x = torch.randn(v, 1, hidden, dtype=dtype, device=device)
    pos = torch.full((v, 1), c, dtype=torch.long, device=device)

    def run() -> None:
        model(inputs_embeds=x, past_key_values=cache, position_ids=pos, use_cache=True)
        cache.crop(-1)  # back to c cached tokens (cropping is part of the timed step; it is a view)

    return run, cache


def _head_runner(head, hidden: int, v: int, _length: int, dtype, device: str):
    x = torch.randn(v, hidden, dtype=dtype, device=device)

    def run() -> None:
        head(x)

    return run, None


RUNNERS = {"prefill": _prefill_runner, "decode": _decode_runner, "head": _head_runner}


def _mean(run, device: str, clock, inner: int) -> float:
    total = 0.0
    for _ in range(inner):
        _sync(device)
        t0 = clock()
        run()
        _sync(device)
        total += clock() - t0
    return total / inner


def profile_local(
    shape: ModelShape,
    device: str = "cpu",
    threads: int | None = 1,
    prefill_grid: Iterable[tuple[int, int]] | None = None,
    decode_grid: Iterable[tuple[int, int]] | None = None,
    reps: int = 3,
    progress: bool = True,
    dtype: torch.dtype | None = None,
    clock: str | None = None,
    min_time_s: float = 0.05,
    seed: int = 0,
    head: bool = True,
) -> Profile:
    """Measured profile of one decoder layer of ``shape`` at 16 bits (fp32 on CPU, fp16 on GPU).

    With ``head`` the LM head is timed too, on ``v`` tokens for every batch size ``v`` of the decode
    grid (``samples[16]["head"] = [(v, 0, seconds)]``), in the same rounds and by the same clock.

    Robust to a loaded machine: every point is warmed up, then the whole grid is timed ``reps``
    times in rounds, each round in a fresh random order (so a burst of load from other jobs hits
    different points each round rather than a run of neighbouring shapes), every timing repeats
    the call until ``min_time_s`` of clock time have passed, and each point keeps its *minimum*
    over the rounds (other jobs only ever add time). ``clock`` is ``thread`` (default for a
    one-thread CPU profile: CPU time of this thread, blind to time slices other processes
    take), ``process`` or ``wall`` (default on a GPU or with several threads).
    """
    clock = clock or default_clock(device, threads)
    fn = clock_fn(clock)
    if clock == "thread" and (device != "cpu" or threads != 1):
        raise ValueError("the thread clock needs device cpu and threads=1 (work elsewhere is not counted)")
    prev_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    if dtype is None:
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
    pre_grid = list(prefill_grid or [(v, s) for v in PREFILL_BATCHES for s in PREFILL_LENGTHS])
    dec_grid = list(decode_grid or [(v, c) for v in DECODE_BATCHES for c in DECODE_CONTEXTS])
    head_batches = sorted({v for v, _ in dec_grid}) if head else []
    points = (
        [("prefill", v, s) for v, s in pre_grid]
        + [("decode", v, c) for v, c in dec_grid]
        + [("head", v, 0) for v in head_batches]
    )
    rng = random.Random(seed)
    times: dict[tuple, list[float]] = {p: [] for p in points}
    wall0, cpu0 = time.perf_counter(), time.process_time()
    try:
        modules = {"layer": one_layer_model(shape, dtype, device)}
        if head_batches:
            modules["head"] = lm_head_module(shape, dtype, device)
        bar = tqdm(total=len(points) * reps, desc="profiling", disable=not progress)
        runners: dict = {}
        with torch.inference_mode():
            for _ in range(reps):
                order = points.copy()
                rng.shuffle(order)
                for p in order:
                    if p not in runners:
                        phase, v, x = p
                        mod = modules["head" if phase == "head" else "layer"]
                        runners[p] = RUNNERS[phase](mod, shape.hidden, v, x, dtype, device)[0]
                        runners[p]()  # warm-up (allocator, caches)
                    times[p].append(_measure(runners[p], device, fn, min_time_s))
                    bar.update()
        runners.clear()
        modules.clear()
        bar.close()
    finally:
        if threads:
            torch.set_num_threads(prev_threads)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    spread = [statistics.median(t) / min(t) - 1 for t in times.values() if min(t) > 0]
    pre = [(v, s, min(times[("prefill", v, s)])) for v, s in pre_grid]
    dec = [(v, c, min(times[("decode", v, c)])) for v, c in dec_grid]
    samples = {"prefill": pre, "decode": dec}
    if head_batches:
        samples["head"] = [(v, 0, min(times[("head", v, 0)])) for v in head_batches]
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else local_cpu(threads).name
    log.info(
        "profiled %d prefill, %d decode and %d head points on %s (%s clock, %.0f s wall, %.0f s CPU)",
        len(pre),
        len(dec),
        len(head_batches),
        name,
        clock,
        wall,
        cpu,
    )
    return Profile(
        name,
        shape.essentials(),
        "measured",
        {16: samples},
        {
            "dtype": str(dtype).replace("torch.", ""),
            "threads": threads,
            "reps": reps,
            "clock": clock,
            "statistic": "min over rounds of the fastest call",
            "min_time_s": min_time_s,
            "wall_s": wall,
            "process_cpu_s": cpu,
            "median_spread": statistics.median(spread) if spread else 0.0,
            "head": "final norm + Linear(hidden, vocab)" if head_batches else None,
            "torch": torch.__version__,
        },
    )
