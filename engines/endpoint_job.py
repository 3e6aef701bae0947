"""One request of the endpoint backend while it is held (:mod:`engines.endpoint_backend`): its stream so far, and
the partial output it resumed from or would be checkpointed as.

A request claimed with a partial output that has text continues it (:func:`engines.endpoint_stream.continued`):
``/v1/completions`` gets the prompt and the partial text and is asked for the rest of ``max_tokens``; the
output is the partial text and the continuation, its completion tokens the partial output's and the new ones,
its prompt tokens the server's count less the partial output's (the tokenization at the seam may differ from
an uninterrupted run's by a token or two). While it streams, :meth:`Job.partial` is what a checkpoint writes:
the text so far and its tokens (the stream's pieces: one a token on the servers this backend was tried with).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from engines.endpoint_http import Completion
from engines.endpoint_stream import Answer, continued
from engines.interface import Request, RequestOutput
from workqueue.openai_body import CONTINUABLE, unhonoured
from workqueue.partial import Partial


@dataclass
class Job:
    request: Request
    resume: Partial | None = None  # the partial output it continues (engines.endpoint_stream.continued)
    answer: Answer = field(default_factory=Answer)  # the stream now (a new one each time it is sent)
    server_errors: int = 0
    task: asyncio.Task | None = None
    aborted: bool = False  # its batch was cancelled (a task cancelled otherwise keeps its row)
    suspended: bool = False  # taken out under a notice: no output
    done: bool = False

    @classmethod
    def of(cls, request: Request) -> Job:
        return cls(request, continued(request))

    @property
    def resumed(self) -> int:
        """Tokens of the partial output it continues."""
        return len(self.resume) if self.resume is not None else 0

    @property
    def left(self) -> int:
        """Most tokens it may still generate."""
        return self.request.sampling.target_tokens - self.resumed

    def generated(self) -> int:
        """Tokens generated so far, the partial output's included."""
        return self.resumed + len(self.answer.pieces)

    def partial(self) -> Partial | None:
        """What it generated so far as a partial output (None: nothing, or a row a continuation cannot serve)."""
        if unhonoured(self.request.openai_body, CONTINUABLE):
            return None
        pieces = list(self.answer.pieces)  # a copy: the event loop appends to it
        base = self.resume if self.resume is not None else Partial()
        if not pieces and not base:
            return None
        return Partial((), base.text + "".join(pieces), len(base) + len(pieces))

    def ended(self) -> RequestOutput:
        """Its output when the partial output already took every token it may generate."""
        assert self.resume is not None
        return RequestOutput(self.request.request_id, self.resume.text, [], 0, "length", finish_time=time.time(),
                             counted_tokens=self.resumed)  # fmt: skip

    def output(self, done: Completion) -> RequestOutput:
        """Its output from the server's answer: the partial output's text and tokens, and the answer's."""
        base = self.resume
        prompt_tokens = done.prompt_tokens
        if base is not None and done.usage_reported:  # the server counted the partial text as prompt
            prompt_tokens = max(0, prompt_tokens - len(base))
        return RequestOutput(
            self.request.request_id,
            (base.text if base is not None else "") + done.text,
            [],
            prompt_tokens,
            done.finish_reason,
            first_token_time=done.first_token_time or time.time(),
            finish_time=time.time(),
            counted_tokens=self.resumed + done.completion_tokens,
            openai_extra=done.extra or None,
        )
