"""One streamed completion from an OpenAI-compatible inference server, and what its failure means.

:func:`stream_completion` POSTs a chat row to ``/v1/chat/completions``, any other to ``/v1/completions``
(:mod:`engines.endpoint_stream` builds the body and reads the events), with ``"stream": true``: the text,
when the first piece came, the ``finish_reason``, log-probabilities and tool calls, and the server's ``usage``
(asked for with ``stream_options.include_usage``; a server that refuses that field is asked without
it, :class:`UsageOptionRefused`). A failure is one of two kinds:

* :class:`Overloaded`: the server is overloaded, restarting or unreachable (429, 503, 502, 504, 408,
  a refused or dropped connection, a timeout, a stream cut short): the request is retried later,
  and it is never the row's failure;
* :class:`Rejected`: the server refused this request (another 4xx: the row fails with its message),
  or failed on it (500, an error in the stream: tried again a few times, then the row fails).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx

from engines.endpoint_stream import USAGE_OPTION, Answer

#: statuses that say "later", not "never"
OVERLOAD_STATUSES = frozenset({408, 429, 502, 503, 504})


class Overloaded(Exception):
    """The endpoint cannot answer now; ``retry_after_s``: what its ``Retry-After`` asked for."""

    def __init__(self, why: str, retry_after_s: float | None = None) -> None:
        super().__init__(why)
        self.retry_after_s = retry_after_s


class Rejected(Exception):
    """The endpoint answered this request with an error; ``retryable``: a server error (5xx), not a refusal."""

    def __init__(self, why: str, retryable: bool) -> None:
        super().__init__(why)
        self.retryable = retryable


class UsageOptionRefused(Exception):
    """The endpoint refused ``stream_options``: ask it again without (its usage may then be missing)."""


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    first_token_time: float  # epoch seconds of the first piece of text (0: none came)
    usage_reported: bool  # False: the server sent no usage; the counts are the stream's pieces, prompt 0
    extra: dict = field(default_factory=dict)  # logprobs, tool_calls (engines.endpoint_stream.Answer.extra)
    cut: bool = False  # the connection closed after the finish: its usage (if the server sends one) was lost


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers.get("retry-after", ""))
    except ValueError:
        return None  # absent, or an HTTP date: the backoff decides


def _message(raw: bytes) -> str:
    """The error text of an error body (OpenAI's ``error.message``, FastAPI's ``detail``, else the text)."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return text[:500]


async def _check_status(response: httpx.Response, url: str) -> None:
    if response.status_code == 200:
        return
    message = _message(await response.aread())
    where = f"{url}: HTTP {response.status_code}"
    if response.status_code in OVERLOAD_STATUSES:
        raise Overloaded(f"{where}: {message}", _retry_after(response))
    if response.status_code in (400, 422) and USAGE_OPTION in message:
        raise UsageOptionRefused(f"{where}: {message}")
    raise Rejected(f"{where}: {message}", retryable=response.status_code >= 500)


async def stream_completion(
    client: httpx.AsyncClient,
    base_url: str,
    request: tuple[str, dict],
    headers: dict[str, str],
    answer: Answer | None = None,
) -> Completion:
    """Run one streamed request, ``(path, body)`` of :func:`engines.endpoint_stream.request_body` (module
    docstring), its events read into ``answer`` as they come (a new one if None: the caller's can be read
    meanwhile, for a checkpoint); raises :class:`Overloaded`, :class:`Rejected` or :class:`UsageOptionRefused`."""
    path, body = request
    url = base_url + path
    answer = Answer() if answer is None else answer
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            await _check_status(response, url)
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    raise Rejected(f"{url}: not JSON in the stream: {data[:200]!r}", retryable=True) from None
                if not isinstance(event, dict):
                    raise Rejected(f"{url}: unexpected event in the stream: {data[:200]!r}", retryable=True)
                if "error" in event:
                    raise Rejected(f"{url}: error in the stream: {_message(data.encode())}", retryable=True)
                answer.add(event)
    except httpx.TransportError as e:  # refused, reset, timed out, cut short
        if not answer.finish_reason:  # else the answer is whole: only its usage or end of stream was lost
            raise Overloaded(f"{url}: {type(e).__name__}: {e}") from None
        cut = True
    else:
        cut = False
    if not answer.finish_reason:
        raise Overloaded(f"{url}: the stream ended before the completion did")
    done = Completion(answer.text, 0, len(answer.pieces), answer.finish_reason, answer.first_token_time,
                      usage_reported=False, extra=answer.extra(), cut=cut)  # fmt: skip
    if answer.usage is None:
        return done
    try:
        done.prompt_tokens = int(answer.usage["prompt_tokens"])
        done.completion_tokens = int(answer.usage["completion_tokens"])
    except (KeyError, TypeError, ValueError):
        raise Rejected(f"{url}: usage without token counts: {answer.usage}", retryable=True) from None
    done.usage_reported = True
    return done


async def served_models(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> list[str]:
    """The model names ``GET /v1/models`` lists; raises :class:`Overloaded` or :class:`Rejected`."""
    url = base_url + "/models"
    try:
        response = await client.get(url, headers=headers)
    except httpx.TransportError as e:
        raise Overloaded(f"{url}: {type(e).__name__}: {e}") from None
    await _check_status(response, url)
    try:
        data = response.json()["data"]
        return [str(m["id"]) for m in data]
    except (ValueError, KeyError, TypeError):
        raise Rejected(f"{url}: not an OpenAI model list: {response.text[:200]!r}", retryable=False) from None
