"""A cheap upper bound on a prompt's token count, so that a large batch is validated without tokenizing it.

The gateway must reject a prompt that does not fit the model (see
:func:`gateway.checks.validation.token_problems`) before it answers, but tokenizing 100,000 prompts
takes seconds. For a byte-level BPE tokenizer with no normalizer (GPT-2 style, and the
project's default tokenizer) every token stands for at least one byte of the UTF-8 prompt,
so ``bytes + special tokens + 1`` (the 1 for a prefix space the pre-tokenizer may add) bounds
the count from above. A prompt whose bound fits its limit cannot be too long; its exact count
is taken later, chunk by chunk, by the background intake (:mod:`gateway.intake.background`). Other
tokenizers get no bound, and every prompt is counted before the answer, as before.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenizers import pre_tokenizers


def token_bound(tokenizer) -> Callable[[str], int] | None:
    """A function giving an upper bound of ``len(tokenizer(prompt).input_ids)``, or None when
    the tokenizer is not one for which the byte bound is known to hold."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None  # a normalizer may expand text (NFKD turns one character into up to 18)
    if type(backend.model).__name__ != "BPE" or not isinstance(
        backend.pre_tokenizer, pre_tokenizers.ByteLevel
    ):
        return None
    extra = len(backend.encode("", add_special_tokens=True).ids) + 1

    def bound(prompt: str) -> int:
        return len(prompt.encode()) + extra

    return bound
