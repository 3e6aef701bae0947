"""Shape-only configs of public models (no weights) for accounting and synthetic omega (:mod:`quant.shape_config`:
no transformers import; a local model directory's own config is read with transformers)."""

from __future__ import annotations

from typing import Any

from quant.shape_config import llama_config, opt_config

_OPT = {  # name: (hidden, layers, heads, ffn)
    "opt-125m": (768, 12, 12, 3072),
    "opt-1.3b": (2048, 24, 32, 8192),
    "opt-6.7b": (4096, 32, 32, 16384),
    "opt-13b": (5120, 40, 40, 20480),
    "opt-30b": (7168, 48, 56, 28672),
    "opt-66b": (9216, 64, 72, 36864),
}
_LLAMA = {  # name: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "llama-2-7b": (4096, 32, 32, 32, 11008, 32000),
    "llama-2-13b": (5120, 40, 40, 40, 13824, 32000),
    "llama-2-70b": (8192, 80, 64, 8, 28672, 32000),
    "llama-3-8b": (4096, 32, 32, 8, 14336, 128256),
    "llama-3-70b": (8192, 80, 64, 8, 28672, 128256),
}
#: other spellings of the same shapes (LLaMA-1 7b/13b have the shapes of Llama-2 7b/13b)
ALIASES = {
    "llama-7b": "llama-2-7b",
    "llama-13b": "llama-2-13b",
    "llama3-8b": "llama-3-8b",
    "llama3-70b": "llama-3-70b",
}
NAMES = tuple(_OPT) + tuple(_LLAMA)


def canonical_name(name: str) -> str | None:
    """The table name of a known public model (aliases resolved, case-insensitive), else None."""
    key = ALIASES.get(name.lower(), name.lower())
    return key if key in _OPT or key in _LLAMA else None


def named_config(name: str) -> Any:
    """A config by public model name (see :data:`NAMES` and :data:`ALIASES`), or from a local model directory."""
    name = canonical_name(name) or name
    if name in _OPT:
        h, n, heads, ffn = _OPT[name]
        return opt_config(h, n, heads, ffn, vocab=50272)
    if name in _LLAMA:
        h, n, heads, kv, inter, vocab = _LLAMA[name]
        return llama_config(h, n, heads, kv, inter, vocab)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"unknown model {name!r}: not one of {', '.join(NAMES)} nor a local model directory"
        ) from e
