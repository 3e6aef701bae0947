"""Quality of bit maps: held-out perplexity of a model under uniform and mixed bit maps.

``fleetbatch quant eval`` compares, on the ``heldout`` split of :mod:`quant.textdata`:
fp16 weights, uniform int8/int4/int3, and mixed maps at *equal weight bytes* -- half of the
decoder layers at the high bit width and half at the low one -- chosen by the variance indicator
(the layers with the largest ``omega(i, low) - omega(i, high)`` get the high bits) versus random
maps with the same byte total (median over ``n_random`` maps). The same comparison is also run
per linear operator (half of each shape class across layers at high bits) since a tiny model has
few layers. Int8/int4 KV-cache quality is checked by fake-quantizing K and V per token and head
on the k/v projection outputs (keys before RoPE; an approximation of a post-RoPE cache).
"""

from __future__ import annotations

import copy
import logging
import math
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from quant.accounting import head_dim, layer_linear_biases, layer_linear_shapes
from quant.apply import apply_bitmap, bitmap_weight_bytes, decoder_layers
from quant.indicator import collect_input_moments, variance_indicator
from quant.kv import fake_quantize_kv
from quant.textdata import split_texts, token_blocks

log = logging.getLogger(__name__)


def calibration_blocks(tokenizer, tokens: int = 512, seq_len: int = 128, root=None) -> torch.Tensor:
    """A few hundred tokens of real text (``calib`` split) as ``(n, seq_len)`` blocks."""
    return token_blocks(split_texts("calib", root), tokenizer, seq_len, max_tokens=max(tokens, seq_len))


def heldout_blocks(tokenizer, tokens: int = 4096, seq_len: int = 128, root=None) -> torch.Tensor:
    return token_blocks(split_texts("heldout", root), tokenizer, seq_len, max_tokens=max(tokens, seq_len))


@torch.no_grad()
def perplexity(model: nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> float:
    """``exp`` of the mean next-token NLL over all blocks."""
    model.eval()
    nll, count = 0.0, 0
    for x in blocks.split(batch_size):
        logits = model(input_ids=x).logits[:, :-1].float()
        tgt = x[:, 1:]
        nll += float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum"
            )
        )
        count += tgt.numel()
    return math.exp(nll / count)


def fp16_copy(model: nn.Module) -> nn.Module:
    """A float32 copy whose weights are rounded to fp16 (the unquantized reference)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(torch.float16).to(p.dtype))
    return m


def quantized_copy(model: nn.Module, bit_map: Any, group_size: int | None, symmetric: bool) -> nn.Module:
    return apply_bitmap(fp16_copy(model), bit_map, group_size, symmetric)


def layer_maps(omega: dict[int, dict[int, float]], low: int, high: int, n_random: int, seed: int):
    """``(guided, anti_guided, randoms)`` per-layer maps with half the layers at ``high`` bits."""
    n = len(omega)
    k = n // 2
    gain = sorted(range(n), key=lambda i: omega[i][low] - omega[i][high], reverse=True)
    guided = [high if i in gain[:k] else low for i in range(n)]
    anti = [high if i in gain[n - k :] else low for i in range(n)]
    rng = random.Random(seed)
    randoms = []
    for _ in range(n_random):
        pick = set(rng.sample(range(n), k))
        randoms.append([high if i in pick else low for i in range(n)])
    return guided, anti, randoms


def op_maps(config, per_op, low: int, high: int, n_random: int, seed: int):
    """Per-operator maps: half of each shape class (same in/out/bias) across layers at ``high`` bits."""
    shapes = {
        n: (i, o, b)
        for (n, i, o), b in zip(
            layer_linear_shapes(config), layer_linear_biases(config).values(), strict=True
        )
    }
    classes: dict[tuple, list[tuple[int, str]]] = {}
    for layer, ops in per_op.items():
        for name in ops:
            classes.setdefault(shapes[name], []).append((layer, name))
    rng = random.Random(seed)

    def build(choose: Callable[[list[tuple[int, str]], int], list[tuple[int, str]]]):
        bm: dict[int, dict[str, int]] = {i: {} for i in per_op}
        for members in classes.values():
            hi = set(choose(members, len(members) // 2))
            for layer, name in members:
                bm[layer][name] = high if (layer, name) in hi else low
        return bm

    def by_gain(members, k, reverse=True):
        return sorted(
            members, key=lambda m: per_op[m[0]][m[1]][low] - per_op[m[0]][m[1]][high], reverse=reverse
        )[:k]

    guided = build(by_gain)
    anti = build(lambda m, k: by_gain(m, k, reverse=False))
    randoms = [build(lambda m, k: rng.sample(m, k)) for _ in range(n_random)]
    return guided, anti, randoms


class KVFakeQuant:
    """Forward hooks fake-quantizing k/v projection outputs per (token, head) while active."""

    def __init__(self, model: nn.Module, bits: int) -> None:
        self.handles = []
        hd = head_dim(model.config)
        for layer in decoder_layers(model):
            attn = getattr(layer, "self_attn", None)
            for name in ("k_proj", "v_proj"):
                mod = getattr(attn, name, None) if attn is not None else None
                if mod is None:
                    raise ValueError(
                        "KV fake quantization supports Llama/OPT-style k_proj/v_proj modules only"
                    )

                def hook(_m, _args, out, hd=hd):
                    shp = out.shape
                    q = fake_quantize_kv(out.reshape(*shp[:-1], shp[-1] // hd, hd), bits, axis=-1)
                    return q.reshape(shp)

                self.handles.append(mod.register_forward_hook(hook))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def evaluate(
    model: nn.Module,
    tokenizer,
    eval_tokens: int = 4096,
    calib_tokens: int = 512,
    seq_len: int = 128,
    low: int = 3,
    high: int = 8,
    n_random: int = 10,
    group_size: int | None = 128,
    symmetric: bool = True,
    seed: int = 0,
    data_dir=None,
    plot: str | Path | None = None,
) -> dict:
    """All figures of ``fleetbatch quant eval`` (see the module docstring)."""
    cfg = model.config
    L = cfg.num_hidden_layers
    if L < 2:
        raise ValueError("mixed maps need a model with at least 2 decoder layers")
    blocks = heldout_blocks(tokenizer, eval_tokens, seq_len, data_dir)
    calib = calibration_blocks(tokenizer, calib_tokens, seq_len, data_dir)
    base = fp16_copy(model)
    moments = collect_input_moments(base, calib.split(4))
    omega, per_op = variance_indicator(base, moments, (low, high, 16), group_size, symmetric)
    res: dict[str, Any] = {
        "layers": L,
        "eval_tokens": int(blocks.numel()),
        "calib_tokens": int(calib.numel()),
    }
    res["group_size"], res["symmetric"], res["low_bits"], res["high_bits"] = group_size, symmetric, low, high

    def run(name: str, bm) -> float:
        m = quantized_copy(model, bm, group_size, symmetric)
        ppl = perplexity(m, blocks)
        log.info("%s: ppl %.3f", name, ppl)
        return ppl

    g, a, rnd = layer_maps(omega, low, high, n_random, seed)
    go, ao, rndo = op_maps(cfg, per_op, low, high, n_random, seed)
    total = 4 + 2 + len(rnd) + 2 + len(rndo) + 2
    bar = tqdm(total=total, desc="fleetbatch quant eval", unit="ppl")

    def step(v):
        bar.update(1)
        return v

    res["ppl_fp16"] = step(perplexity(base, blocks))
    res["bytes_fp16"] = bitmap_weight_bytes(cfg, [16] * L, group_size, symmetric)
    for b in (8, 4, 3):
        res[f"ppl_int{b}"] = step(run(f"int{b}", [b] * L))
        res[f"bytes_int{b}"] = bitmap_weight_bytes(cfg, [b] * L, group_size, symmetric)
    res["guided_map"] = g
    res["ppl_guided_mixed"] = step(run("guided", g))
    res["ppl_antiguided_mixed"] = step(run("anti-guided", a))
    rnd_ppl = [step(run(f"random {i}", m)) for i, m in enumerate(rnd)]
    res["ppl_random_mixed_median"] = statistics.median(rnd_ppl)
    res["ppl_random_mixed_all"] = rnd_ppl
    bytes_mixed = {bitmap_weight_bytes(cfg, m, group_size, symmetric) for m in [g, a, *rnd]}
    if len(bytes_mixed) != 1:
        raise AssertionError(f"mixed maps differ in bytes: {bytes_mixed}")
    res["bytes_mixed"] = bytes_mixed.pop()
    res["ppl_guided_mixed_ops"] = step(run("guided per-op", go))
    res["ppl_antiguided_mixed_ops"] = step(run("anti-guided per-op", ao))
    rop = [step(run(f"random per-op {i}", m)) for i, m in enumerate(rndo)]
    res["ppl_random_mixed_ops_median"] = statistics.median(rop)
    res["ppl_random_mixed_ops_all"] = rop
    bytes_ops = {bitmap_weight_bytes(cfg, m, group_size, symmetric) for m in [go, ao, *rndo]}
    if len(bytes_ops) != 1:
        raise AssertionError(f"per-op mixed maps differ in bytes: {bytes_ops}")
    res["bytes_mixed_ops"] = bytes_ops.pop()
    for kb in (8, 4):
        hooks = KVFakeQuant(base, kb)
        try:
            res[f"ppl_kv{kb}"] = step(perplexity(base, blocks))
        finally:
            hooks.close()
    bar.close()
    res["guided_beats_random"] = res["ppl_guided_mixed"] < res["ppl_random_mixed_median"]
    res["omega"] = {i: {b: v for b, v in o.items()} for i, o in omega.items()}
    if plot:
        _plot(res, Path(plot))
        res["plot"] = str(plot)
    return res


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    mb = 1e6
    pts = [(res["bytes_fp16"], res["ppl_fp16"], "fp16")] + [
        (res[f"bytes_int{b}"], res[f"ppl_int{b}"], f"int{b}") for b in (8, 4, 3)
    ]
    ax.plot([p[0] / mb for p in pts], [p[1] for p in pts], "o-", label="uniform")
    for x, y, t in pts:
        ax.annotate(t, (x / mb, y))
    ax.scatter(
        [res["bytes_mixed"] / mb] * len(res["ppl_random_mixed_all"]),
        res["ppl_random_mixed_all"],
        marker="x",
        c="gray",
        label="random per-layer",
    )
    ax.scatter(
        [res["bytes_mixed_ops"] / mb] * len(res["ppl_random_mixed_ops_all"]),
        res["ppl_random_mixed_ops_all"],
        marker="+",
        c="silver",
        label="random per-op",
    )
    ax.scatter(
        [res["bytes_mixed"] / mb],
        [res["ppl_guided_mixed"]],
        marker="*",
        s=120,
        c="red",
        label="omega-guided per-layer",
    )
    ax.scatter(
        [res["bytes_mixed_ops"] / mb],
        [res["ppl_guided_mixed_ops"]],
        marker="*",
        s=120,
        c="orange",
        label="omega-guided per-op",
    )
    ax.set_xlabel("decoder weight bytes (MB)")
    ax.set_ylabel("held-out perplexity")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
