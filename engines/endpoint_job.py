"""One request of the endpoint backend while it is held (:mod:`engines.endpoint_backend`): its stream so far, and
the partial output it resumed from or would be checkpointed as.

A request claimed with a partial output that has text continues it, as does a request whose stream was cut
short (:meth:`Job.carry_on`: a server killed mid-answer, a dropped connection): ``/v1/completions`` gets the
prompt and the partial text (a :class:`~engines.endpoint_stream.Continuation`) and is asked for the rest of
``max_tokens``. A chat row's prompt is rendered here with the served model's own chat template
(:class:`ChatRenderer`, from ``fleetbatch engine serve --endpoint-tokenizer DIR``); without it a chat row is not
continued but runs again from the start, as does a row asking for what a continuation cannot give the whole
answer (:func:`workqueue.openai_body.continuable`). The output is the partial text and the continuation, its
completion tokens the partial output's and the new ones, its prompt tokens the server's count less the partial
output's (the tokenization at the seam may differ from an uninterrupted run's by a token or two). While it
streams, :meth:`Job.partial` is what a checkpoint writes: the text so far and its tokens (the stream's pieces:
one a token on the servers this backend was tried with).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from engines.endpoint_http import Completion
from engines.endpoint_stream import Answer, Continuation, request_body
from engines.interface import Request, RequestOutput
from workqueue.openai_body import continuable
from workqueue.partial import Partial

log = logging.getLogger(__name__)


class ChatRenderer:
    """A chat as the served model's server renders it (its tokenizer's chat template), as ``/v1/completions`` text:
    without the start token the template writes where the server's tokenizer adds one to every prompt itself."""

    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        bos, ids = tokenizer.bos_token, tokenizer("a")["input_ids"]
        self.added_start = bos if bos and ids and ids[0] == tokenizer.bos_token_id else ""

    def __call__(self, messages: list) -> str | None:
        """The rendered chat (None: the template refused it: the row runs again from the start)."""
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template may refuse roles or orders (jinja's raise_exception)
            log.warning("the chat template refused a chat to continue (%s): it runs again from the start", e)
            return None
        return text.removeprefix(self.added_start) if self.added_start else text


def chat_renderer(tokenizer_dir: str | None) -> ChatRenderer | None:
    """The renderer of ``--endpoint-tokenizer DIR`` (None: not given); a ValueError says what is wrong with it."""
    if not tokenizer_dir:
        return None
    if not Path(tokenizer_dir).is_dir():
        raise ValueError(
            f"--endpoint-tokenizer {tokenizer_dir}: no such directory (the model's tokenizer files)"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"--endpoint-tokenizer {tokenizer_dir}: cannot load a tokenizer there: {e}"
        ) from None
    try:
        renderer = ChatRenderer(tokenizer)
    except ValueError as e:
        raise ValueError(
            f"--endpoint-tokenizer {tokenizer_dir}: {e} (it is read to render a chat row continued elsewhere)"
        ) from None
    log.info(
        "a chat row resumed from a partial output is rendered with the chat template of %s", tokenizer_dir
    )
    return renderer


@dataclass(eq=False)
class Job:
    request: Request
    continuable: bool = False  # a continuation can give its whole answer (module docstring)
    chat: ChatRenderer | None = None  # renders its chat for a continuation
    resume: Partial | None = None  # the partial output it continues (its claim's, or its cut-short stream's)
    answer: Answer = field(default_factory=Answer)  # the stream now (a new one each time it is sent)
    server_errors: int = 0
    task: asyncio.Task | None = None
    aborted: bool = False  # its batch was cancelled (a task cancelled otherwise keeps its row)
    suspended: bool = False  # taken out under a notice: no output
    done: bool = False

    @classmethod
    def of(cls, request: Request, chat: ChatRenderer | None) -> Job:
        """The job of ``request``, continuing its partial output where it can (module docstring)."""
        body = request.openai_body
        can = continuable(body) and (chat is not None or not body.get("messages"))
        resume = request.resume if can and request.resume and request.resume.text else None
        return cls(request, can, chat, resume)

    @property
    def resumed(self) -> int:
        """Tokens of the partial output it continues."""
        return len(self.resume) if self.resume is not None else 0

    @property
    def left(self) -> int:
        """Most tokens it may still generate."""
        return self.request.sampling.target_tokens - self.resumed

    def body(self, model: str, usage_option: bool) -> tuple[str, dict]:
        """What to send now: the request, or the continuation of its partial output."""
        go_on = None
        if self.resume is not None:
            messages = self.request.openai_body.get("messages")
            prompt = self.chat(messages) if messages and self.chat is not None else self.request.prompt
            if prompt is None:  # the template refused it: from the start
                self.resume = None
            else:
                go_on = Continuation(prompt + self.resume.text, self.left)
        return request_body(model, self.request, usage_option, go_on)

    def generated(self) -> int:
        """Tokens generated so far, the partial output's included."""
        return self.resumed + len(self.answer.pieces)

    def partial(self) -> Partial | None:
        """What it generated so far as a partial output (None: nothing, or a row a continuation cannot serve)."""
        if not self.continuable:
            return None
        pieces = list(self.answer.pieces)  # a copy: the event loop appends to it
        base = self.resume if self.resume is not None else Partial()
        if not pieces and not base:
            return None
        return Partial((), base.text + "".join(pieces), len(base) + len(pieces))

    def carry_on(self) -> None:
        """Its stream was cut short: what came becomes the partial output the next send continues (where the row
        can be continued; else it starts again)."""
        taken = self.partial()
        if taken is not None and len(taken) > self.resumed:
            self.resume = taken
        self.answer = Answer()  # counted in the partial output now, not twice

    def empty(self, reason: str, error: str = "") -> RequestOutput:
        """An output without an answer: ``abort`` (its batch cancelled) or ``error`` (``error`` says why)."""
        return RequestOutput(self.request.request_id, "", [], 0, reason, finish_time=time.time(), error=error)

    def ended(self) -> RequestOutput:
        """Its output when the partial output already took every token it may generate."""
        assert self.resume is not None
        return RequestOutput(self.request.request_id, self.resume.text, [], 0, "length", finish_time=time.time(),
                             counted_tokens=self.resumed)  # fmt: skip

    def output(self, done: Completion) -> RequestOutput:
        """Its output from the server's answer: the partial output's text and tokens, and the answer's (cut at a
        stop string across the seam, which the server could not see: its usage still counts what it generated)."""
        base = self.resume
        prompt_tokens, text, reason = done.prompt_tokens, done.text, done.finish_reason
        if base is not None:
            if done.usage_reported:  # the server counted the partial text as prompt
                prompt_tokens = max(0, prompt_tokens - len(base))
            text, stopped = stop_across(base.text, done.text, self.request.openai_body.get("stop"))
            reason = "stop" if stopped else reason
        return RequestOutput(
            self.request.request_id,
            text,
            [],
            prompt_tokens,
            reason,
            first_token_time=done.first_token_time or time.time(),
            finish_time=time.time(),
            counted_tokens=self.resumed + done.completion_tokens,
            openai_extra=done.extra or None,
        )


def stop_across(before: str, after: str, stop: object) -> tuple[str, bool]:
    """``before + after`` cut at the first stop string that starts in ``before`` and ends in ``after`` (the seam of a
    continuation: a server sees only ``after``), and whether one was found."""
    text = before + after
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    found = [
        i
        for s in stops
        if isinstance(s, str)
        and s
        and 0 <= (i := text.find(s, max(0, len(before) - len(s) + 1))) < len(before)
    ]
    return (text[: min(found)], True) if found else (text, False)
