"""Workloads for ``loadgen``: a generated default mix, real datasets, and OpenAI batch JSONL files.

Every source yields :class:`WorkItem` objects (id, prompt, max_tokens, optional forced
length and sampling settings, metadata). The generated mix needs no data files: prompts of
three kinds (tool calls, explanations, long-form writing) whose response lengths differ by
an order of magnitude, like the real mixed workload, with lengths tied to the prompt's
wording so that a length predictor has something to learn.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fleetdata.datasets import load_dataset, response_lengths
from gateway.http_api.format import CHAT, DEFAULT_CHAT, ChatTemplate, parse_row

_TOPICS = (
    "rivers", "tax forms", "sorting algorithms", "the moon", "coffee", "bridges", "solar panels", "chess",
    "volcanoes", "a small bakery", "train timetables", "bees", "compilers", "ancient Rome", "jazz", "glaciers",
)  # fmt: skip
_KINDS = (
    # kind, share, prompt templates, (median, spread) of response tokens
    ("tool", 0.45, ("Look up {t}.", "Call the search tool for {t}.", "Give the one-word category of {t}."), (12, 0.4)),
    ("explain", 0.35, ("Explain {t} in a short paragraph.", "What should a beginner know about {t}?"), (70, 0.35)),
    ("write", 0.20, ("Write a long, detailed story about {t}, with several scenes.", "Write an in-depth essay on {t}."), (220, 0.3)),
)  # fmt: skip


@dataclass
class WorkItem:
    id: str
    prompt: str
    max_tokens: int = 256
    forced_length: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    true_length: int | None = None  # the recorded response length, when known
    openai_body: str = ""  # an OpenAI row's request (JSON: its messages, model, fields passed through)


def generated(n: int, seed: int = 0, max_tokens: int = 256, forced: bool = True) -> list[WorkItem]:
    """The default generated workload (no dataset text)."""
    rng = random.Random(seed)
    shares = [k[1] for k in _KINDS]
    items = []
    for i in range(n):
        kind, _, templates, (median, spread) = rng.choices(_KINDS, weights=shares)[0]
        prompt = rng.choice(templates).format(t=rng.choice(_TOPICS))
        length = max(1, min(max_tokens, int(round(rng.lognormvariate(0, spread) * median))))
        items.append(
            WorkItem(
                id=f"g{i:06d}",
                prompt=prompt,
                max_tokens=max_tokens,
                forced_length=length if forced else None,
                metadata={"source": f"generated-{kind}"},
                true_length=length,
            )
        )
    return items


def from_dataset(
    name: str, n: int, seed: int = 0, max_tokens: int = 256, forced: bool = True, tokenizer=None
) -> list[WorkItem]:
    """``n`` records sampled (deterministically) from a dataset of ``../shared/data``.

    With ``forced``, each query generates exactly its recorded response length in tokens of
    ``tokenizer`` (capped at ``max_tokens``).
    """

    records = load_dataset(name)
    rng = random.Random(seed)
    picked = rng.sample(records, min(n, len(records)))
    lengths = response_lengths(picked, tokenizer)
    return [
        WorkItem(
            id=f"{r.source}-{i:06d}",
            prompt=r.prompt,
            max_tokens=max_tokens,
            forced_length=max(1, min(max_tokens, length)) if forced else None,
            metadata={"source": r.source},
            true_length=length,
        )
        for i, (r, length) in enumerate(zip(picked, lengths, strict=True))
    ]


class OpenAIFile:
    """An OpenAI Batch input file (``custom_id``, ``url``, ``body`` with ``messages`` or ``prompt``) read row
    by row, never whole: iterating yields its :class:`WorkItem` objects (each pass reads the file anew, so a
    retried submission can send it again); ``limit`` stops after that many rows.

    Chat messages are rendered by ``template`` (:class:`gateway.http_api.format.ChatTemplate`: the
    served model's own, or the documented default asked for by name; neither: a chat row is an error). ``max_tokens`` (or
    ``max_completion_tokens``), ``temperature``, ``top_p`` and ``seed`` are honoured; any other
    body field that would change the answer is an error naming it and its line
    (:func:`gateway.http_api.format.check_body`). :meth:`endpoint` is a row's ``url`` and :meth:`model` its
    body's ``model`` after a pass: only rows whose pair is not the first row's are remembered (a file has one
    endpoint and one model, as a rule).
    """

    def __init__(
        self,
        path: str | Path,
        default_max_tokens: int = 256,
        template: ChatTemplate = DEFAULT_CHAT,
        limit: int | None = None,
    ):
        self.path, self.default_max_tokens, self.template, self.limit = (
            Path(path),
            default_max_tokens,
            template,
            limit,
        )
        self._first: tuple[str, str] | None = None  # the first row's url and model
        self._others: dict[str, tuple[str, str]] = {}  # by custom_id, the rows whose pair is another

    def __iter__(self) -> Iterator[WorkItem]:
        sent = 0
        with open(self.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if self.limit is not None and sent >= self.limit:
                    return
                try:
                    row = json.loads(line)
                    item = _openai_item(row, self.default_max_tokens, self.template)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{self.path}:{lineno}: not valid JSON ({e.msg})") from None
                except ValueError as e:
                    raise ValueError(f"{self.path}:{lineno}: {e}") from None
                self._remember(item.id, row)
                sent += 1
                yield item

    def _remember(self, custom_id: str, row: dict) -> None:
        body = row.get("body")
        pair = (row.get("url") or CHAT, str(body.get("model") or "") if isinstance(body, dict) else "")
        if self._first is None:
            self._first = pair
        elif pair != self._first:
            self._others[custom_id] = pair

    def _pair(self, custom_id: str) -> tuple[str, str]:
        """The ``url`` and ``model`` of the row ``custom_id``; the file is read for them first when no pass has
        (a resumed submission sends nothing)."""
        if self._first is None:
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        row = json.loads(line)
                        self._remember(str(row.get("custom_id")), row)
        return self._others.get(custom_id) or self._first or (CHAT, "")

    def endpoint(self, custom_id: str) -> str:
        """The ``url`` of the row ``custom_id`` (``/v1/chat/completions`` when absent)."""
        return self._pair(custom_id)[0]

    def model(self, custom_id: str) -> str:
        """The ``model`` its body names ("" when absent)."""
        return self._pair(custom_id)[1]

    def rows_after(self, n: int) -> int:
        """How many non-empty lines the file has after its first ``n`` rows (counted, not parsed)."""
        with open(self.path, encoding="utf-8") as f:
            return max(0, sum(1 for line in f if line.strip()) - n)


def from_openai_jsonl(
    path: str | Path, default_max_tokens: int = 256, template: ChatTemplate = DEFAULT_CHAT
) -> list[WorkItem]:
    """Every row of an OpenAI Batch input file, as a list (:class:`OpenAIFile` reads it row by row)."""
    return list(OpenAIFile(path, default_max_tokens, template))


def _openai_item(row: dict, default_max_tokens: int, template: ChatTemplate) -> WorkItem:
    r = parse_row(row, default_max_tokens, template)
    return WorkItem(
        id=r.custom_id,
        prompt=r.prompt,
        max_tokens=r.max_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        seed=r.seed,
        metadata={"source": "jsonl"},
        openai_body=r.openai_body,
    )


def write_jsonl(rows: Sequence[dict], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
