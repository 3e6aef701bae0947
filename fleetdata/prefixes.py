"""A batch whose rows share long prefixes, built from the real data (issue [5/6]).

Real batch files repeat themselves: thousands of rows carry the same instructions or few-shot
examples and only the question changes. :func:`shared_prefix_rows` builds such a batch from
``../shared/data``: ``groups`` few-shot blocks, each made of worked examples from the gsm8k
training set (different examples for each block, ``prefix_words`` words each: 120-480
words are about 200-800 tokens of the local tokenizer), each put in front of many real questions from the mixed sources; plus a
share of rows with no shared prefix. Every row keeps its question's recorded response, so
response lengths are real. :func:`unique_rows` is the same questions with no prefix, the
workload a cache cannot help.

A row's record carries ``meta["group"]`` (the block's index, ``None`` for a unique row) and
``meta["system"]`` (the block itself; the row's prompt is the block, a blank line, then the
question), so a caller can send the block as a chat's system message or as the prompt's head.
"""

from __future__ import annotations

import random
from pathlib import Path

from fleetdata.datasets import Record, load_gsm8k, load_mixed

#: words of one worked example in a few-shot block are capped so that blocks stay in range
_MAX_EXAMPLE_WORDS = 160
_QUESTION_SOURCES = ("alpaca_eval", "code_alpaca", "roleplay", "toolformer")


def _blocks(groups: int, prefix_words: tuple[int, int], rng: random.Random, root: Path | None) -> list[str]:
    examples = [
        r for r in load_gsm8k("train", root) if len(r.prompt.split()) + r.words() < _MAX_EXAMPLE_WORDS
    ]
    rng.shuffle(examples)
    blocks, at = [], 0
    lo, hi = prefix_words
    for g in range(groups):
        target = rng.randint(lo, hi)
        parts = [f"Task family {g}: answer in the style of these worked examples."]
        words = len(parts[0].split())
        while words < target:
            if at >= len(examples):
                raise ValueError(f"not enough worked examples for {groups} blocks of {prefix_words} words")
            ex = examples[at]
            at += 1
            parts.append(f"Question: {ex.prompt}\nAnswer: {ex.response}")
            words += len(ex.prompt.split()) + ex.words() + 2
        blocks.append("\n\n".join(parts))
    return blocks


def _questions(n: int, rng: random.Random, root: Path | None) -> list[Record]:
    pool = [r for r in load_mixed(root, _QUESTION_SOURCES) if r.prompt.strip() and r.response.strip()]
    if n > len(pool):
        raise ValueError(f"asked for {n} rows, the question sources hold {len(pool)}")
    return rng.sample(pool, n)


def shared_prefix_rows(
    n: int,
    groups: int = 8,
    unique_share: float = 0.2,
    prefix_words: tuple[int, int] = (120, 480),
    seed: int = 0,
    root: Path | None = None,
    shuffle: bool = True,
) -> list[Record]:
    """``n`` rows: ``unique_share`` of them plain questions, the rest spread over ``groups`` few-shot
    blocks (group sizes vary: each group's share is drawn at random, every group has at least one
    row). ``shuffle``: rows in random order, as a batch file written without care would be;
    else grouped, each group's rows together."""
    if n < 1 or groups < 0 or not 0.0 <= unique_share <= 1.0:
        raise ValueError(
            f"need n >= 1, groups >= 0 and 0 <= unique_share <= 1, got {n}, {groups}, {unique_share}"
        )
    if prefix_words[0] < 1 or prefix_words[1] < prefix_words[0]:
        raise ValueError(f"prefix_words must be (lo, hi) with 1 <= lo <= hi, got {prefix_words}")
    rng = random.Random(seed)
    grouped = 0 if groups == 0 else min(n, max(groups, round(n * (1.0 - unique_share))))
    blocks = _blocks(groups, prefix_words, rng, root) if grouped else []
    weights = [rng.uniform(0.5, 1.5) for _ in blocks]
    sizes = [1] * len(blocks)
    extra = max(0, grouped - len(blocks))  # choices over no blocks fails, even for none
    for g in rng.choices(range(len(blocks)), weights=weights, k=extra) if extra else []:
        sizes[g] += 1
    rows: list[Record] = []
    questions = iter(_questions(n, rng, root))
    for g, size in enumerate(sizes):
        for _ in range(size):
            q = next(questions)
            meta = {"group": g, "system": blocks[g], "question": q.prompt}
            rows.append(Record(f"{blocks[g]}\n\n{q.prompt}", q.response, q.source, meta=meta))
    for q in questions:
        rows.append(
            Record(q.prompt, q.response, q.source, meta={"group": None, "system": "", "question": q.prompt})
        )
    if shuffle:
        rng.shuffle(rows)
    return rows


def unique_rows(rows: list[Record]) -> list[Record]:
    """The same questions with no shared prefix: each row's question alone, after a line naming the
    row, so that no two prompts share even their first tokens (some sources' questions open with the
    same instructions)."""
    return [
        Record(
            f"Row {i}.\n{r.meta.get('question', r.prompt)}",
            r.response,
            r.source,
            meta={"group": None, "system": ""},
        )
        for i, r in enumerate(rows)
    ]
