"""The load of ``fleetbatch loadgen chaos``: waves of generated queries, and the rows some faults need.

* **Waves.** The batch is cut into one wave per fault plus one; wave ``k + 1`` is submitted only
  once fault ``k`` has fired and healed, so the run cannot finish before its last fault,
  however fast the machine (issue 31, finding 11).
* **Held rows.** The wave of a fault that needs it still running (an engine holding a lease, the
  client's stream open: ``load.chaos.faults.HELD_WAVE_FAULTS``) has one row forced to
  :data:`HELD_TOKENS` tokens (:func:`held`), so it is when the fault looks.
* **Cluster limits.** The first cluster takes queries of at most ``SMALL_LIMIT`` tokens
  (``max_query_tokens``); the second takes any that fit its KV cache. A *big* row (a long
  prompt, a few tokens out) therefore fits only the second cluster.
* **KV-exhausting rows**: a short prompt (the gateway predicts a short answer, so it admits
  it) forced to generate as many tokens as the engine's whole KV cache holds: it outgrows the
  cache and cannot ever run to its end. Failing it *with the KV cache's error* is legitimate;
  so is failing the one big row left on a removed cluster *with an error naming the removal*
  (:func:`legit_failure`). Any other failure of them is a wrongly failed row.
"""

from __future__ import annotations

from dataclasses import replace

from load.workload import WorkItem, generated

SMALL_LIMIT = 128  # max_query_tokens of the first cluster: every generated row fits (<= ~70 tokens)
KV_BUDGET = 384  # KV cache of every engine, in tokens: four generated rows or one big row fit
BIG_PROMPT = " ".join(["the river carries water and stones to the sea"] * 20)  # ~200 tokens
KV_PROMPT = "Count slowly from one to ten thousand, one number per line."  # ~16 tokens
HELD_TOKENS = 200  # a held row's answer (:func:`held`): with its prompt within KV_BUDGET
#: rows that may fail for good, by id prefix, and the words their error must hold: they cannot run
#: (the KV cache cannot hold them) or only a removed cluster could take them
LEGIT_ERRORS = {"kv-": "kv cache", "sole-": "removed"}


def waves(n: int, k: int, seed: int, max_tokens: int) -> list[list[WorkItem]]:
    """``n`` generated queries cut into ``k`` waves (the first ones one larger when ``k`` does not divide ``n``)."""
    items = generated(n, seed=seed, max_tokens=max_tokens)
    size, extra = divmod(n, k)
    out, start = [], 0
    for w in range(k):
        end = start + size + (1 if w < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def held(item: WorkItem) -> WorkItem:
    """``item`` forced to :data:`HELD_TOKENS` tokens: the wave of a fault that needs it still running (an engine
    holding a lease, the client's stream open) keeps one row running for hundreds of engine steps, however fast
    the machine (its short rows can all be done within one look of the fault's, on a quiet one)."""
    return replace(item, max_tokens=HELD_TOKENS, forced_length=HELD_TOKENS)


def big_row(qid: str, out_tokens: int = 4) -> WorkItem:
    """A row that fits only the second cluster (prompt + predicted > ``SMALL_LIMIT``)."""
    return WorkItem(id=qid, prompt=BIG_PROMPT, max_tokens=out_tokens, forced_length=out_tokens)


def kv_row(qid: str, kv_budget: int = KV_BUDGET) -> WorkItem:
    """A row that outgrows the KV cache of ``kv_budget`` tokens."""
    return WorkItem(id=qid, prompt=KV_PROMPT, max_tokens=kv_budget, forced_length=kv_budget)


def intake_rows(n: int, seed: int, every: int = 5) -> list[WorkItem]:
    """A large batch for background intake: cheap rows (2 tokens out), every ``every``-th one big."""
    rows = []
    for i, it in enumerate(generated(n, seed=seed + 7, max_tokens=2)):
        rows.append(big_row(f"intake-big-{i:05d}", 2) if i % every == 0 else it)
    return rows


def legit_failure(query_id: str, error: str | None) -> bool:
    """Whether a row may fail for good in a chaos run, with this ``error`` (see the module docstring)."""
    return any(
        query_id.startswith(prefix) and words in (error or "").lower()
        for prefix, words in LEGIT_ERRORS.items()
    )
