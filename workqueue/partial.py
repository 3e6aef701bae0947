"""A query's partial output: what a run generated before its cluster was preempted or its engine killed.

A worker checkpoints the queries it runs (every ``--checkpoint-tokens`` tokens, and at once on a
preemption notice): their generated token ids where its engine has them (the native engine, vLLM), the
text they decode to, and how many tokens that is, go to the query's hash (field
:data:`workqueue.keys.PARTIAL`, written by the CHECKPOINT script of :mod:`workqueue.scripts` only while
that worker runs the query). The next CLAIM hands the partial output out with the query; an engine
that can resume continues it and generates only the rest of ``max_tokens``: the native engine and vLLM from
the token ids (or, from a partial output with text only, the text's tokens), the endpoint backend from the
text (the prompt and the text so far sent to ``/v1/completions``). The field goes with the query's hash
when its result is written (``finish`` in :mod:`workqueue.lua_queue`), in the same script.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Partial:
    """The tokens a query generated so far: ``token_ids`` (empty where the writer had none: the endpoint
    backend sees text), ``text`` (what they decode to; empty from a writer that does not decode) and
    ``count``, how many tokens that is (None: ``len(token_ids)``). Its length is the count."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    count: int | None = None

    def __len__(self) -> int:
        return len(self.token_ids) if self.count is None else self.count

    def encode(self) -> str:
        body = {"token_ids": list(self.token_ids), "text": self.text, "tokens": len(self)}
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes | None) -> Partial | None:
        """The partial output a hash field holds (None: none, or an empty one)."""
        if not raw:
            return None
        body = json.loads(raw)
        ids = tuple(int(t) for t in body.get("token_ids") or ())
        text = str(body.get("text") or "")
        count = body.get("tokens")
        count = len(ids) if count is None else int(count)
        if not count or not (ids or text):
            return None
        return cls(ids, text, None if count == len(ids) else count)
