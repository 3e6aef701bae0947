"""``quant`` command line: train-tiny, indicator, synthetic-indicator, bytes, eval, kv-bench.

Every subcommand prints, as its last line, one JSON object with its results.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from cliutil import PLAIN_LOG, run_main
from localmodels import load_model, load_or_build
from quant.accounting import decoder_layer_weight_bytes, kv_bytes_per_token, non_layer_weight_bytes
from quant.configs import named_config
from quant.evaluate import calibration_blocks, evaluate
from quant.indicator import collect_input_moments, save_indicator, synthetic_indicator, variance_indicator
from quant.train import TrainConfig, train_tiny

log = logging.getLogger("quant")


def _group(v: str) -> int | None:
    if v.lower() in ("none", "channel", "0"):
        return None
    try:
        g = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"group size must be a positive integer or 'channel', not {v!r}"
        ) from None
    if g <= 0:
        raise argparse.ArgumentTypeError(f"group size must be positive, not {g}")
    return g


def _bits_list(v: str) -> list[int]:
    try:
        bits = sorted({int(b) for b in v.split(",") if b.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bits must be a comma-separated list of integers, not {v!r}"
        ) from None
    bad = [b for b in bits if b not in (2, 3, 4, 8, 16)]
    if bad or not bits:
        raise argparse.ArgumentTypeError(f"bit widths must be among 2,3,4,8,16; got {v!r}")
    return bits


def _quant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--group-size",
        type=_group,
        default=128,
        help="weights per scale along in_features, or 'channel' (default 128)",
    )
    p.add_argument(
        "--asymmetric", action="store_true", help="asymmetric RTN with uint8 zero points (default symmetric)"
    )


def cmd_train_tiny(a: argparse.Namespace) -> dict:
    if a.hidden <= 0 or a.hidden % 64:
        raise ValueError(f"--hidden must be a positive multiple of 64, not {a.hidden}")
    return train_tiny(
        TrainConfig(
            out_dir=a.out,
            max_steps=a.max_steps,
            minutes=a.minutes,
            batch_size=a.batch_size,
            seq_len=a.seq_len,
            layers=a.layers,
            hidden=a.hidden,
            heads=a.hidden // 32,
            kv_heads=max(1, a.hidden // 64),
            intermediate=int(a.hidden * 2.6875),
            lr=a.lr,
            max_train_tokens=a.max_train_tokens,
            seed=a.seed,
            data_dir=a.data_dir,
        )
    )


def cmd_indicator(a: argparse.Namespace) -> dict:
    model, tok = load_or_build(a.served_model, size=a.size)
    calib = calibration_blocks(tok, a.calib_tokens, a.seq_len, a.data_dir)
    moments = collect_input_moments(model, calib.split(8))
    omega, _ = variance_indicator(model, moments, a.bits, a.group_size, not a.asymmetric, a.error_model)
    meta = {
        "model": a.served_model or f"random-llama-{a.size}",
        "source": "measured",
        "calib_tokens": int(calib.numel()),
        "group_size": a.group_size,
        "symmetric": not a.asymmetric,
        "error_model": a.error_model,
    }
    save_indicator(a.out, omega, meta)
    return {"out": a.out, "layers": len(omega), "bits": a.bits, "calib_tokens": int(calib.numel())}


def cmd_synthetic(a: argparse.Namespace) -> dict:
    cfg = named_config(a.shape)
    omega = synthetic_indicator(cfg, a.bits, a.seed, a.group_size, not a.asymmetric)
    save_indicator(
        a.out, omega, {"model": a.shape, "source": "synthetic", "seed": a.seed, "group_size": a.group_size}
    )
    return {"out": a.out, "layers": len(omega), "bits": a.bits, "synthetic": True}


def cmd_bytes(a: argparse.Namespace) -> dict:
    cfg = named_config(a.shape)
    sym = not a.asymmetric
    layer = {str(b): decoder_layer_weight_bytes(cfg, b, a.group_size, sym) for b in (16, 8, 4, 3, 2)}
    n = cfg.num_hidden_layers
    return {
        "model": a.shape,
        "layers": n,
        "layer_bytes": layer,
        "model_bytes": {b: v * n + non_layer_weight_bytes(cfg) for b, v in layer.items()},
        "non_layer_bytes": non_layer_weight_bytes(cfg),
        "kv_bytes_per_token_per_layer": {str(b): kv_bytes_per_token(cfg, b) for b in (16, 8, 4)},
    }


def cmd_eval(a: argparse.Namespace) -> dict:
    if not (Path(a.served_model) / "config.json").exists():
        raise FileNotFoundError(
            f"{a.served_model} is not a model directory (no config.json); run `fleetbatch quant train-tiny` first"
        )
    torch.set_num_threads(a.threads)
    model, tok = load_model(a.served_model)
    res = evaluate(
        model,
        tok,
        eval_tokens=a.eval_tokens,
        calib_tokens=a.calib_tokens,
        seq_len=a.seq_len,
        low=a.low,
        high=a.high,
        n_random=a.n_random,
        group_size=a.group_size,
        symmetric=not a.asymmetric,
        seed=a.seed,
        data_dir=a.data_dir,
        plot=a.plot,
    )
    res["model"] = a.served_model
    return res


def build_parser(prog: str = "fleetbatch quant") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Mixed-precision weight-only quantization (RTN 2/3/4/8 bit, packed), exact memory "
        "accounting, the LLM-PQ variance indicator, KV-cache quantization and perplexity checks.",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser(
        "train-tiny", help="train a small Llama LM on the shared text and save it as a model directory"
    )
    p.add_argument(
        "--out", default="runs/tiny-llama", help="output model directory (default runs/tiny-llama)"
    )
    p.add_argument("--max-steps", type=int, default=400, help="optimizer steps (default 400)")
    p.add_argument(
        "--minutes", type=float, default=5.0, help="wall-clock budget; stops early when spent (default 5)"
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--hidden",
        type=int,
        default=128,
        help="hidden size, a multiple of 64 (default 128; heads = hidden/32)",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument(
        "--max-train-tokens",
        type=int,
        default=1_000_000,
        help="tokens of training text to tokenize (default 1M)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data-dir", default=None, help="shared data directory (default $FLEETBATCH_DATA or ../shared/data)"
    )
    p.set_defaults(func=cmd_train_tiny)

    p = sub.add_parser(
        "indicator", help="measure the variance indicator omega(layer, bits) and save it as JSON"
    )
    p.add_argument("--served-model", metavar="DIR", default=None, help="model directory (default: a random Llama of --size)")
    p.add_argument("--size", default="tiny", help="size of the random model when --served-model is not given")
    p.add_argument("--out", default="omega.json", help="output JSON file (default omega.json)")
    p.add_argument(
        "--bits", type=_bits_list, default=[3, 4, 8, 16], help="comma-separated bit widths (default 3,4,8,16)"
    )
    p.add_argument(
        "--calib-tokens", type=int, default=512, help="calibration tokens of real text (default 512)"
    )
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument(
        "--error-model",
        choices=("uniform", "bound"),
        default="uniform",
        help="c=1/12 (measured RTN) or 1/4 (LLM-PQ)",
    )
    p.add_argument("--data-dir", default=None)
    _quant_args(p)
    p.set_defaults(func=cmd_indicator)

    p = sub.add_parser(
        "synthetic-indicator",
        help="fabricate a plausible omega for a big model from its shapes (not measured)",
    )
    p.add_argument(
        "--shape", required=True, help="opt-13b, opt-30b, opt-66b, llama-2-7b, ... or a local model directory"
    )
    p.add_argument("--out", default="omega-synthetic.json")
    p.add_argument("--bits", type=_bits_list, default=[3, 4, 8, 16])
    p.add_argument("--seed", type=int, default=0)
    _quant_args(p)
    p.set_defaults(func=cmd_synthetic)

    p = sub.add_parser("bytes", help="exact weight and KV bytes of a model's decoder layers per bit width")
    p.add_argument(
        "--shape", required=True, help="opt-13b, opt-30b, opt-66b, llama-2-7b, ... or a local model directory"
    )
    _quant_args(p)
    p.set_defaults(func=cmd_bytes)

    p = sub.add_parser(
        "eval",
        help="held-out perplexity: fp16, int8/4/3, omega-guided vs random mixed maps at equal bytes, KV int8/int4",
    )
    p.add_argument(
        "--served-model", metavar="DIR", default="runs/tiny-llama", help="trained model directory (default runs/tiny-llama)"
    )
    p.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens (default 4096)")
    p.add_argument("--calib-tokens", type=int, default=512, help="calibration tokens for omega (default 512)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument(
        "--low", type=int, choices=(2, 3, 4), default=3, help="low bit width of mixed maps (default 3)"
    )
    p.add_argument(
        "--high", type=int, choices=(4, 8), default=8, help="high bit width of mixed maps (default 8)"
    )
    p.add_argument("--n-random", type=int, default=10, help="random maps at equal bytes (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plot", default=None, help="save a perplexity-vs-bytes plot (PNG) here")
    p.add_argument("--data-dir", default=None)
    _quant_args(p)
    p.set_defaults(func=cmd_eval)

    return ap


def main(argv: list[str] | None = None, prog: str = "fleetbatch quant") -> int:
    errors = (ValueError, FileNotFoundError, OSError, TypeError)
    spec = {"errors": errors, "log_format": PLAIN_LOG, "print_json": True, "json_default": str}
    return run_main(build_parser(prog), argv, lambda a: a.func(a), prog=prog, **spec)


if __name__ == "__main__":
    sys.exit(main())
