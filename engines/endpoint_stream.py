"""One request to an OpenAI-compatible server, both ways: the body sent, and the answer put together from
the streamed events.

:func:`request_body` builds a chat row's ``/v1/chat/completions`` body from the row's own messages (the
server applies its own chat template), any other row's ``/v1/completions`` body from its prompt; the
OpenAI fields the row carries (:data:`workqueue.openai_body.PASS_THROUGH`) go as the row gives them. A row
resumed from a partial output continues its text through ``/v1/completions`` (a :class:`Continuation`,
:mod:`engines.endpoint_job`).
:class:`Answer` reads each event's first choice: the text (``text``, or a chat ``delta.content``), the
``finish_reason``, the log-probabilities (a chat's ``logprobs.content`` entries, a completion's
``tokens``/``token_logprobs``/``top_logprobs``/``text_offset`` lists, each joined in order) and a chat's
tool calls (the pieces of each call, by its ``index``, joined: ``id``, ``type`` and the function's
``name`` and ``arguments``); :meth:`Answer.extra` is what the result keeps beyond the text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engines.interface import Request
from workqueue.openai_body import fields_used

CHAT_PATH = "/chat/completions"
COMPLETIONS_PATH = "/completions"
#: the field that asks a streamed answer for its ``usage`` (a server may refuse it: engines.endpoint_http)
USAGE_OPTION = "stream_options"


@dataclass(frozen=True)
class Continuation:
    """What a request resumed from a partial output sends instead of its own chat or prompt: the prompt (a chat
    row's rendered with the served model's template) with the partial text after it, and the tokens left."""

    prompt: str
    max_tokens: int


def request_body(
    model: str, request: Request, usage_option: bool, continuation: Continuation | None = None
) -> tuple[str, dict]:
    """The path (under the base URL) and body of ``request``: its chat or prompt, sampling and fields; a
    ``continuation`` goes to ``/v1/completions`` for the rest of its tokens."""
    s, given = request.sampling, request.openai_body
    body: dict = {"model": model}
    if continuation is not None:
        path, body["prompt"] = COMPLETIONS_PATH, continuation.prompt
    elif given.get("messages"):
        path, body["messages"] = CHAT_PATH, given["messages"]
    else:
        path, body["prompt"] = COMPLETIONS_PATH, request.prompt
    body.update(
        # a forced length is a bound here: the API has no "ignore EOS"
        max_tokens=continuation.max_tokens if continuation is not None else s.target_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        stream=True,
    )
    if s.seed is not None:
        body["seed"] = s.seed
    for name in fields_used(given):
        body[name] = given[name]
    if usage_option:
        body[USAGE_OPTION] = {"include_usage": True}
    return path, body


@dataclass
class Answer:
    """What the events of one stream said so far (see the module's docstring)."""

    pieces: list[str] = field(default_factory=list)
    first_token_time: float = 0.0
    finish_reason: str = ""
    usage: dict | None = None
    logprobs: dict | None = None
    tool_calls: dict[int, dict] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, event: dict) -> None:
        """Take one event (a parsed ``data:`` line) into the answer."""
        for choice in (event.get("choices") or [])[:1]:  # one choice per request (n = 1)
            delta = choice.get("delta") or {}
            text = choice.get("text") or delta.get("content") or ""
            if text:
                self.pieces.append(text)
                self.first_token_time = self.first_token_time or time.time()
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            if isinstance(choice.get("logprobs"), dict):
                self._add_logprobs(choice["logprobs"])
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    self._add_call(call)
                    self.first_token_time = self.first_token_time or time.time()
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]

    def _add_logprobs(self, part: dict) -> None:
        if self.logprobs is None:
            self.logprobs = {}
        for key, value in part.items():
            if isinstance(value, list):
                self.logprobs.setdefault(key, []).extend(value)
            elif key not in self.logprobs:
                self.logprobs[key] = value

    def _add_call(self, piece: dict) -> None:
        call = self.tool_calls.setdefault(
            int(piece.get("index") or 0),
            {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
        )
        call["id"] = piece.get("id") or call["id"]
        call["type"] = piece.get("type") or call["type"]
        function = piece.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""

    def extra(self) -> dict:
        """What the result keeps beyond the text (:data:`workqueue.openai_body.EXTRA_ANSWERS`)."""
        out: dict = {}
        if self.logprobs:
            out["logprobs"] = self.logprobs
        if self.tool_calls:
            out["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return out


__all__ = ["CHAT_PATH", "COMPLETIONS_PATH", "USAGE_OPTION", "Answer", "Continuation", "request_body"]
