"""Small Hugging Face models and tokenizers built on this machine (no downloads).

Shared by ``engines`` (the default serving model), ``quant`` (``train-tiny``) and the
benchmarks: a byte-level BPE tokenizer trained locally, decoder configs of real
architectures (Llama, GPT-2, OPT) at small sizes with random weights, and loading of a
real model directory when a user gives one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localmodels.build import (
        ARCHS,
        SIZES,
        build_model,
        default_corpus,
        default_tokenizer,
        generated_corpus,
        load_model,
        load_or_build,
        train_tokenizer,
    )


def __getattr__(name: str):
    """The builders are imported on first use (``localmodels.build`` imports torch and transformers,
    which a command that only reads ``localmodels.paths`` does without)."""
    if name in _TOKENIZER:  # the tokenizer alone imports no torch
        return getattr(importlib.import_module("localmodels.tokenizer"), name)
    if name in _SIZES:  # nor do the sizes
        return getattr(importlib.import_module("localmodels.sizes"), name)
    if name in __all__:
        return getattr(importlib.import_module("localmodels.build"), name)
    raise AttributeError(f"module 'localmodels' has no attribute {name!r}")


_TOKENIZER = ("default_corpus", "default_tokenizer", "generated_corpus", "train_tokenizer")
_SIZES = ("ARCHS", "SIZES")
__all__ = [
    "ARCHS",
    "SIZES",
    "build_model",
    "default_corpus",
    "default_tokenizer",
    "generated_corpus",
    "load_model",
    "load_or_build",
    "train_tokenizer",
]
