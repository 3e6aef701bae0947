"""Prefix groups of a batch: which prompts share a long head of tokens (issue [5/6]).

**The rule** (one rule for chat rows and plain prompts: a chat row's template puts its system
part first, so its system message is the head of its prompt). A prompt's head is cut into full
blocks of ``block`` tokens, as the engine's prefix cache keys them, counting only blocks the
engine could reuse (at most ``(prompt_tokens - 1) // block`` of them: it computes at least one
token) and at most ``max_tokens`` tokens. Two prompts share a prefix of ``d`` tokens when their
first ``d / block`` blocks are equal. A prompt's ``prefix_tokens`` is the longest prefix it shares
with any other prompt of the same call; when that is at least ``min_tokens`` (64 by default: a
shorter head saves too little prefill to shape an assignment), the prompt joins the group keyed
by a hash of its first ``min_tokens`` tokens, else it has no group. Coarse keys keep nested
sharing together: prompts with the same instructions and different example sets share a group,
and the finer sharing inside it (:func:`group_order` puts it side by side).

The groups are found per call (one batch, or one intake chunk); the key is a hash of token ids,
so the same head gives the same key in every call and every gateway replica. Cost: one hash
and one sort per call, comparisons at C speed (list slices); the head of each prompt is
tokenized once (:func:`prefix_finder`).

Pure module apart from :func:`prefix_finder`'s tokenizer: no Redis, no gRPC, no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: characters of a prompt's head that are tokenized to find its prefix (about 4 per token)
CHARS_PER_TOKEN = 6


@dataclass(frozen=True)
class PrefixRule:
    """How prefix groups are found (see the module docstring)."""

    block: int = 16  # the engine's KV block size (EngineConfig.block_size)
    min_tokens: int = 64  # a group shares at least this many tokens
    max_tokens: int = 2048  # the longest head looked at

    def __post_init__(self) -> None:
        if self.block < 1 or self.min_tokens < self.block or self.max_tokens < self.min_tokens:
            raise ValueError(f"need 1 <= block <= min_tokens <= max_tokens, got {self}")


Prefix = tuple[str | None, int]  # (group key or None, prefix tokens shared with another prompt)


def _usable(ids: Sequence[int], prompt_tokens: int, rule: PrefixRule) -> int:
    """Tokens of the head that the engine could serve from its cache: whole blocks only."""
    n = min(len(ids), max(0, prompt_tokens - 1), rule.max_tokens)
    return n - n % rule.block


def _common(a: Sequence[int], b: Sequence[int], limit: int, block: int) -> int:
    """Tokens of the longest run of equal whole blocks at the head of ``a`` and ``b`` (at most ``limit``)."""
    d = 0
    while d + block <= limit and a[d : d + block] == b[d : d + block]:
        d += block
    return d


def find_prefixes(
    ids: Sequence[Sequence[int]], prompt_tokens: Sequence[int] | None = None, rule: PrefixRule = PrefixRule()
) -> list[Prefix]:
    """``(group, prefix_tokens)`` per prompt, given each prompt's head token ids (``prompt_tokens``: each
    prompt's full count, default ``len(ids[i])``). Prompts with no group get ``(None, 0)``."""
    n = len(ids)
    counts = [len(x) for x in ids] if prompt_tokens is None else list(prompt_tokens)
    if len(counts) != n:
        raise ValueError(f"{n} prompts but {len(counts)} token counts")
    usable = [_usable(ids[i], counts[i], rule) for i in range(n)]
    heads = [list(ids[i][: usable[i]]) for i in range(n)]
    order = sorted((i for i in range(n) if usable[i] >= rule.min_tokens), key=heads.__getitem__)
    depth = [0] * n
    for a, b in zip(order, order[1:], strict=False):  # neighbours in sorted order share the most
        d = _common(heads[a], heads[b], min(usable[a], usable[b]), rule.block)
        depth[a] = max(depth[a], d)
        depth[b] = max(depth[b], d)
    out: list[Prefix] = []
    for i in range(n):
        if depth[i] < rule.min_tokens:
            out.append((None, 0))
            continue
        head = array("q", heads[i][: rule.min_tokens]).tobytes()
        out.append((hashlib.blake2b(head, digest_size=8).hexdigest(), depth[i]))
    return out


def prefixes_of(
    find: Callable[[list[str], list[int]], list[Prefix]] | None, prompts: list[str], counts: list[int]
) -> list[Prefix]:
    """``find(prompts, counts)``, or no group for any prompt when ``find`` is None."""
    return find(prompts, counts) if find is not None else [(None, 0)] * len(prompts)


def prefix_finder(
    tokenizer, rule: PrefixRule = PrefixRule()
) -> Callable[[list[str], list[int]], list[Prefix]]:
    """:func:`find_prefixes` on prompts, given their token counts: the head (``CHARS_PER_TOKEN *
    max_tokens`` characters) of each prompt longer than ``min_tokens`` is tokenized as the engine
    tokenizes it (a shorter one cannot share enough)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    encode = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
    cut = CHARS_PER_TOKEN * rule.max_tokens

    def head_ids(prompts: list[str]) -> list[list[int]]:
        heads = [p[:cut] for p in prompts]
        if encode is not None and backend.truncation is None and backend.padding is None:
            return [e.ids for e in encode(heads, add_special_tokens=True)]
        return [list(x) for x in tokenizer(heads, add_special_tokens=True)["input_ids"]]

    def find(prompts: list[str], prompt_tokens: list[int]) -> list[Prefix]:
        out: list[Prefix] = [(None, 0)] * len(prompts)
        long = [i for i, n in enumerate(prompt_tokens) if n > rule.min_tokens]  # only these can share enough
        if long:
            found = find_prefixes(
                head_ids([prompts[i] for i in long]), [prompt_tokens[i] for i in long], rule
            )
            for i, f in zip(long, found, strict=True):
                out[i] = f
        return out

    return find
