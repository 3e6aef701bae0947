"""Time one real decoder layer on the local device over a (batch x length) grid and write a profile.

The layer is a one-layer Hugging Face model of the given shape with random weights (no
embeddings or LM head in the timing: ``inputs_embeds`` in, hidden states out). Prefill times
a forward over ``v x s`` tokens; decode times one new token per sequence on a cache already
holding ``c`` tokens (the cache is cropped back after each step). Each point is the minimum over
repetitions of the mean of ``inner`` runs: the minimum is the figure least disturbed by other
processes on a shared machine. One thread by default, for the same reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

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

    cfg = shape.config.__class__(**{**shape.config.to_dict(), "num_hidden_layers": 1, "n_layer": 1})
    if hasattr(cfg, "num_hidden_layers"):
        cfg.num_hidden_layers = 1
    torch.manual_seed(seed)
    return AutoModel.from_config(cfg).to(device=device, dtype=dtype).eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_prefill(model, hidden: int, v: int, s: int, dtype, device: str, reps: int, inner: int) -> float:
    x = torch.randn(v, s, hidden, dtype=dtype, device=device)
    best = float("inf")
    with torch.inference_mode():
        model(inputs_embeds=x, use_cache=False)  # warm-up
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                model(inputs_embeds=x, use_cache=False)
            _sync(device)
            best = min(best, (time.perf_counter() - t0) / inner)
    return best


def time_decode(model, hidden: int, v: int, c: int, dtype, device: str, reps: int, inner: int) -> float:
    with torch.inference_mode():
        cache = model(
            inputs_embeds=torch.randn(v, c, hidden, dtype=dtype, device=device), use_cache=True
        ).past_key_values
        x = torch.randn(v, 1, hidden, dtype=dtype, device=device)
        pos = torch.full((v, 1), c, dtype=torch.long, device=device)
        model(inputs_embeds=x, past_key_values=cache, position_ids=pos, use_cache=True)
        cache.crop(-1)
        best = float("inf")
        for _ in range(reps):
            total = 0.0
            for _ in range(inner):
                _sync(device)
                t0 = time.perf_counter()
                model(inputs_embeds=x, past_key_values=cache, position_ids=pos, use_cache=True)
                _sync(device)
                total += time.perf_counter() - t0
                cache.crop(-1)
            best = min(best, total / inner)
    return best


def profile_local(
    shape: ModelShape,
    device: str = "cpu",
    threads: int | None = 1,
    prefill_grid: Iterable[tuple[int, int]] | None = None,
    decode_grid: Iterable[tuple[int, int]] | None = None,
    reps: int = 3,
    progress: bool = True,
    dtype: torch.dtype | None = None,
) -> Profile:
    """Measured profile of one decoder layer of ``shape`` at 16 bits (fp32 on CPU, fp16 on GPU)."""
    if threads:
        torch.set_num_threads(threads)
    if dtype is None:
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
    pre_grid = list(prefill_grid or [(v, s) for v in PREFILL_BATCHES for s in PREFILL_LENGTHS])
    dec_grid = list(decode_grid or [(v, c) for v in DECODE_BATCHES for c in DECODE_CONTEXTS])
    model = one_layer_model(shape, dtype, device)
    pre, dec = [], []
    bar = tqdm(total=len(pre_grid) + len(dec_grid), desc="profiling", disable=not progress)
    for v, s in pre_grid:
        pre.append((v, s, time_prefill(model, shape.hidden, v, s, dtype, device, reps, 1)))
        bar.update()
    for v, c in dec_grid:
        dec.append((v, c, time_decode(model, shape.hidden, v, c, dtype, device, reps, 5)))
        bar.update()
    bar.close()
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else local_cpu(threads).name
    log.info("profiled %d prefill and %d decode points on %s", len(pre), len(dec), name)
    return Profile(
        name,
        shape.essentials(),
        "measured",
        {16: {"prefill": pre, "decode": dec}},
        {
            "dtype": str(dtype).replace("torch.", ""),
            "threads": threads,
            "reps": reps,
            "torch": torch.__version__,
        },
    )


def split_samples(
    rows: Sequence[tuple[float, float, float]], test_batches: Sequence[int], test_lengths: Sequence[int]
) -> tuple[list, list]:
    """(train, test): test rows are those whose batch is in ``test_batches`` *or* length in ``test_lengths``."""
    train = [r for r in rows if r[0] not in test_batches and r[1] not in test_lengths]
    test = [r for r in rows if r[0] in test_batches and r[1] in test_lengths]
    return train, test
