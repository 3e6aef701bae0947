"""Small Hugging Face models and tokenizers built on this machine (no downloads).

Shared by ``engines`` (the default serving model), ``quant`` (``train-tiny``) and the
benchmarks: a byte-level BPE tokenizer trained locally, decoder configs of real
architectures (Llama, GPT-2, OPT) at small sizes with random weights, and loading of a
real model directory when a user gives one.
"""

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
