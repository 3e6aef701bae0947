"""A query's partial output: what a run generated before its cluster was preempted or its engine killed.

A worker checkpoints the queries it runs (every ``--checkpoint-tokens`` tokens, and at once on a
preemption notice): their generated token ids, and the text they decode to, go to the query's hash
(field :data:`workqueue.keys.PARTIAL`, written by the CHECKPOINT script of :mod:`workqueue.scripts`
only while that worker runs the query). The next CLAIM hands the partial output out with the query;
an engine that can resume prefills the prompt and those tokens and decodes only the rest of
``max_tokens``. The field goes with the query's hash when its result is written (``finish`` in
:mod:`workqueue.lua_queue`), in the same script.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Partial:
    """The tokens a query generated so far (``token_ids``), and ``text``: what they decode to, for a backend that
    would continue from the text (none does yet; the native engine resumes from the ids and leaves it empty)."""

    token_ids: tuple[int, ...]
    text: str = ""

    def __len__(self) -> int:
        return len(self.token_ids)

    def encode(self) -> str:
        return json.dumps({"token_ids": list(self.token_ids), "text": self.text}, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes | None) -> Partial | None:
        """The partial output a hash field holds (None: none, or an empty one)."""
        if not raw:
            return None
        body = json.loads(raw)
        ids = tuple(int(t) for t in body.get("token_ids") or ())
        return cls(ids, str(body.get("text") or "")) if ids or body.get("text") else None
