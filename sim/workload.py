"""Simulated queries: prompt tokens, true response length (forced), predicted length, arrival time.

Sources, all through the real loaders of :mod:`load.workload`:

* ``generated`` -- :func:`load.workload.generated` (the default mix of tool calls, explanations
  and long-form writing); the prediction is the mean true length of the same prompt in a
  disjoint training draw (a predictor that learned the prompt-to-length relation), global mean
  for unseen prompts;
* ``mixed`` -- :func:`load.workload.from_dataset` on the real mixed workload of ``../shared/data``
  (lengths in tokens of the serving tokenizer); the prediction comes from the TF-IDF + ridge
  fallback predictor of ``fleetbatch loadgen compare-policies`` fitted on other records of the dataset;
* :func:`bootstrap` -- ``n`` queries resampled from one of the above (the 1,000,000-query scale run).

Arrivals come from :mod:`load.arrivals` (all at once, Poisson, or the Azure trace's timestamps).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fleetdata.datasets import load_dataset, response_lengths
from gateway.assign.policies import QueryLoad
from load.studies.compare_policies import fit_fallback_predictor
from load.workload import WorkItem, from_dataset, generated


@dataclass
class Workload:
    """Parallel per-query lists; query ``i`` is named ``str(i)`` everywhere in the simulator."""

    prompt_tokens: list[int]
    true_tokens: list[int]
    predicted_tokens: list[float]
    arrival_s: list[float]
    source: str = ""
    #: each query's batch's order key (deadline or creation; None: one order), and its deadline (0: none):
    #: a query still queued past its deadline expires
    order_key: list[float] | None = None
    deadline_s: list[float] | None = None
    #: each query's prefix group (None: a prompt of its own) and the head of its prompt it shares with
    #: its group (tokens); the engines give a group's queries the same token ids there (sim.engines)
    prefix_group: list[int | None] | None = None
    prefix_tokens: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.prompt_tokens)
        if not (len(self.true_tokens) == len(self.predicted_tokens) == len(self.arrival_s) == n):
            raise ValueError("workload lists must have one entry per query")
        extra = (self.order_key, self.deadline_s, self.prefix_group, self.prefix_tokens)
        if any(x is not None and len(x) != n for x in extra):
            raise ValueError("workload lists must have one entry per query")
        if (self.prefix_group is None) != (self.prefix_tokens is None) or any(
            not 0 <= s <= p or (g is None and s) for g, s, p in self.prefixes()
        ):
            raise ValueError(
                "prefix_group and prefix_tokens go together, 0 <= prefix <= prompt, 0 without a group"
            )
        if any(t < 1 for t in self.true_tokens):
            raise ValueError("every query must generate at least one token")
        if any(p < 1 for p in self.prompt_tokens):
            raise ValueError("every query needs a prompt of at least one token")

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    def prefixes(self) -> list[tuple[int | None, int, int]]:
        """``(group, prefix tokens, prompt tokens)`` per query (no group for any when none are given)."""
        groups = self.prefix_group or [None] * len(self)
        shared = self.prefix_tokens or [0] * len(self)
        return list(zip(groups, shared, self.prompt_tokens, strict=True))

    def load(self, q: int, plain: bool = False) -> QueryLoad:
        """Query ``q`` as the gateway's policies see it (its prefix group keyed as the gateway keys one;
        ``plain``: none, as the gateway gives a policy that ignores groups)."""
        g = self.prefix_group[q] if self.prefix_group and not plain else None
        shared = self.prefix_tokens[q] if self.prefix_tokens and g is not None else 0
        key = None if g is None else f"g{g}"
        return QueryLoad(str(q), self.prompt_tokens[q], self.predicted_tokens[q], key, shared)

    def with_arrivals(self, arrival_s: Sequence[float]) -> Workload:
        return Workload(
            self.prompt_tokens,
            self.true_tokens,
            self.predicted_tokens,
            list(arrival_s),
            self.source,
            prefix_group=self.prefix_group,
            prefix_tokens=self.prefix_tokens,
        )


def _word_tokens(text: str) -> int:
    return max(1, round(len(text.split()) * 4 / 3))


def _prompt_counter(tokenizer) -> Callable[[str], int]:
    cache: dict[str, int] = {}

    def count(text: str) -> int:
        n = cache.get(text)
        if n is None:
            if tokenizer is None:
                n = _word_tokens(text)
            else:
                n = max(1, len(tokenizer(text, add_special_tokens=True)["input_ids"]))
            cache[text] = n
        return n

    return count


def _from_items(items: Sequence[WorkItem], predicted: Sequence[float], tokenizer, source: str) -> Workload:
    count = _prompt_counter(tokenizer)
    return Workload(
        prompt_tokens=[count(it.prompt) for it in items],
        true_tokens=[int(it.forced_length) for it in items],
        predicted_tokens=[float(p) for p in predicted],
        arrival_s=[0.0] * len(items),
        source=source,
    )


def generated_workload(n: int, seed: int = 0, max_tokens: int = 256, tokenizer=None) -> Workload:
    """``n`` queries of :func:`load.workload.generated` with per-prompt mean predictions (see module doc)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, not {n}")
    items = generated(n, seed=seed, max_tokens=max_tokens, forced=True)
    train = generated(max(2000, min(n, 20000)), seed=seed + 10_007, max_tokens=max_tokens, forced=True)
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for it in train:
        s = sums[it.prompt]
        s[0] += int(it.forced_length)
        s[1] += 1
    overall = sum(s[0] for s in sums.values()) / max(1, sum(s[1] for s in sums.values()))
    pred = [sums[it.prompt][0] / sums[it.prompt][1] if it.prompt in sums else overall for it in items]
    return _from_items(items, pred, tokenizer, "generated")


def mixed_workload(
    n: int, seed: int = 0, max_tokens: int = 256, tokenizer=None, train_max: int = 4000
) -> Workload:
    """``n`` records of the real mixed workload with forced (recorded) lengths and fitted predictions."""
    items = from_dataset("mixed", n, seed=seed, max_tokens=max_tokens, forced=True, tokenizer=tokenizer)
    picked = {it.prompt for it in items}
    rest = [r for r in load_dataset("mixed") if r.prompt not in picked]
    train = random.Random(seed + 1).sample(rest, min(train_max, len(rest)))
    lengths = response_lengths(train, tokenizer)
    predict = fit_fallback_predictor([r.prompt for r in train], lengths, seed)
    pred = np.minimum(predict([it.prompt for it in items]), max_tokens)
    return _from_items(items, [max(1.0, float(p)) for p in pred], tokenizer, "mixed")


def load_workload(name: str, n: int, seed: int = 0, max_tokens: int = 256, tokenizer=None) -> Workload:
    """``generated`` or ``mixed`` (see the module doc)."""
    if name == "generated":
        return generated_workload(n, seed, max_tokens, tokenizer)
    if name == "mixed":
        return mixed_workload(n, seed, max_tokens, tokenizer)
    raise ValueError(f"unknown workload {name!r}; choose generated or mixed")


def bootstrap(base: Workload, n: int, seed: int = 0) -> Workload:
    """``n`` queries drawn with replacement from ``base`` (all arriving at time 0)."""
    idx = np.random.default_rng(seed).integers(0, len(base), n)
    p = np.asarray(base.prompt_tokens)[idx].tolist()
    t = np.asarray(base.true_tokens)[idx].tolist()
    r = np.asarray(base.predicted_tokens, dtype=float)[idx].tolist()
    return Workload(p, t, r, [0.0] * n, base.source + "-bootstrap")
