"""Prompts to token ids, cut to a model's ``max_len``: the one rule the torch members
(:mod:`predictor.inference`) and the fast path (:mod:`predictor.fastpath`) share; imports no torch."""

from __future__ import annotations

from collections.abc import Sequence

TRUNCATIONS = ("head", "head_tail")


def encode(tokenizer, prompts: Sequence[str], max_len: int, truncation: str = "head_tail") -> list[list[int]]:
    """Token ids of each prompt, at most ``max_len`` of them (special tokens included).

    ``head`` keeps the start of a long prompt; ``head_tail`` keeps its first and last halves,
    since the actual question often comes last (after a tool description or a story).
    """
    if truncation == "head":
        return tokenizer(list(prompts), truncation=True, max_length=max_len)["input_ids"]
    if truncation != "head_tail":
        raise ValueError(f"unknown truncation {truncation!r}; choose one of {', '.join(TRUNCATIONS)}")
    head = max_len // 2
    tail = max_len - head
    return [
        x if len(x) <= max_len else x[:head] + x[-tail:]
        for x in tokenizer(list(prompts), verbose=False)["input_ids"]
    ]
