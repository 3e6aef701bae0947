"""A prompt's token ids as the servers count them: one rule for the gateway's counts and the engines' input.

A tokenizer that adds a start token (BOS) adds it to any text; a chat template that writes the BOS
itself (Llama's ``<|begin_of_text|>``, ``<s>``) then gets two. The servers users run tokenize a chat
rendered by its template without adding special tokens (vLLM, ``transformers serve``) and a plain
prompt with them. The rule here: a text that already begins with the tokenizer's BOS gets no second
one; any other text gets the special tokens the tokenizer adds. So the gateway's count of a chat row
equals the ``usage.prompt_tokens`` a server reports for its messages, and the native engine runs the
same ids.
"""

from __future__ import annotations

from collections.abc import Sequence


def adds_special_tokens(tokenizer, text: str) -> bool:
    """Whether ``text`` gets the tokenizer's special tokens (not when it begins with the BOS already)."""
    bos = getattr(tokenizer, "bos_token", None)
    return not (isinstance(bos, str) and bos and text.startswith(bos))


def prompt_ids(tokenizer, text: str) -> list[int]:
    """``text``'s ids by the rule of the module."""
    return list(tokenizer(text, add_special_tokens=adds_special_tokens(tokenizer, text))["input_ids"])


def split_by_rule(tokenizer, texts: Sequence[str]) -> tuple[list[int], list[int]]:
    """The positions of ``texts`` that get special tokens, and those that do not."""
    with_, without = [], []
    for i, t in enumerate(texts):
        (with_ if adds_special_tokens(tokenizer, t) else without).append(i)
    return with_, without
