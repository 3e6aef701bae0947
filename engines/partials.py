"""The native engine's side of partial outputs (:mod:`workqueue.partial`): its generated tokens as a partial output
with their text (so a backend that continues from text, the endpoint one, can resume them too), and the tokens
it resumes a partial output from (its ids, or where it has text only, the text's tokens: the tokenization at the
seam may then differ from the generated one by a token or two)."""

from __future__ import annotations

from collections.abc import Sequence

from workqueue.partial import Partial


def text_of(tokenizer, ids: Sequence[int]) -> str:
    """What ``ids`` decode to, special tokens left out ("" without a tokenizer)."""
    return tokenizer.decode(list(ids), skip_special_tokens=True) if ids and tokenizer is not None else ""


def partial_of(tokenizer, ids: Sequence[int]) -> Partial:
    return Partial(tuple(ids), text_of(tokenizer, ids))


def resumed_ids(tokenizer, resume: Partial | None) -> list[int] | None:
    """The tokens a query resumes from (None: it resumes nothing)."""
    if resume is None:
        return None
    if resume.token_ids or not resume.text or tokenizer is None:
        return list(resume.token_ids)
    return list(tokenizer.encode(resume.text, add_special_tokens=False))
