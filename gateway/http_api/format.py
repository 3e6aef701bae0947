"""OpenAI batch files, the pure part: input rows to queries, results to output lines.

Shared by the gateway's HTTP front (:mod:`gateway.http_api.front`) and ``fleetbatch loadgen submit --jsonl``
(:mod:`load.openai_batch`, :mod:`load.workload`), so both read and write the same shape.

**Input.** One JSON object a line: ``custom_id``, ``method`` (``POST``), ``url``
(``/v1/chat/completions`` or ``/v1/completions``) and ``body`` with ``messages`` or ``prompt``.
Chat messages are rendered with the served model's chat template, or the documented default
(:data:`DEFAULT_TEMPLATE`) when it is asked for by name; with neither, a chat row is an error
(:class:`ChatTemplate`). ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p`` and ``seed`` are honoured. The OpenAI fields
an endpoint backend passes through (:data:`workqueue.openai_body.PASS_THROUGH`: ``response_format``,
``logprobs``, ``tools``, ``stop``, ...) travel with the row in its ``openai_body``, with a chat row's
messages; the gateway refuses them at submission where a cluster cannot honour them. ``n`` > 1,
streaming and any other field are errors that name them (:func:`check_body`).

**Output.** One line per request. A request that succeeded has ``response`` (``status_code``
200, ``request_id`` and a ``body``: a ``chat.completion`` for ``/v1/chat/completions``, a
``text_completion`` for ``/v1/completions``, with ``choices`` and ``usage``) and ``error``
null; it goes to the output file. A request that failed or was cancelled has ``response``
null and ``error`` (``code``, ``message``) and goes to the error file, as OpenAI's batches do.
Which it is comes from :func:`workqueue.outcome`, the rule the worker's counts follow too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.checks.validation import number_problem
from workqueue import Outcome, outcome
from workqueue.openai_body import EXTRA_ANSWERS, PASS_THROUGH, fields_used

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)

#: body fields that are honoured or change nothing about the answer
ACCEPTED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
            "seed", "user", "metadata", "store", "stream", "n"} | PASS_THROUGH  # fmt: skip

#: the documented default chat template, for serving tokenizers without one
DEFAULT_TEMPLATE = "<|{role}|>\n{content}\n"
GENERATION_PROMPT = "<|assistant|>\n"


@dataclass
class OpenAIRequest:
    """One input line as a query: what the engines need, and what its output line names."""

    custom_id: str
    url: str
    prompt: str
    max_tokens: int  # 0: the gateway's default
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    model: str = ""
    openai_body: str = ""  # JSON: the chat's messages, the model and the fields passed through ("": none)


def check_body(body: dict) -> None:
    """Refuse what no backend can honour, naming it: other fields, ``n`` > 1, streaming."""
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise ValueError(f"body fields not supported: {', '.join(unknown)}")
    if body.get("n", 1) != 1:
        raise ValueError(f"n={body['n']} is not supported (one choice per request)")
    if body.get("stream"):
        raise ValueError("stream=true has no meaning in a batch")


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text is supported
        if not all(isinstance(p, dict) for p in content):
            raise ValueError("message content parts must be objects ({'type': 'text', 'text': ...})")
        kinds = sorted({str(p.get("type", "?")) for p in content} - {"text"})
        if kinds:
            raise ValueError(f"message content of type {', '.join(kinds)} is not supported (text only)")
        texts = [p.get("text", "") for p in content]
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("the 'text' of a message content part must be a string")
        return "".join(texts)
    raise ValueError(
        f"message content must be a string or a list of text parts, not {type(content).__name__}"
    )


def render_chat(messages: list, tokenizer=None) -> str:
    """One prompt from chat messages: the tokenizer's chat template when it has one, else
    ``<|role|>`` headers (``<|system|>``, ``<|user|>``, ``<|assistant|>``) with each message on
    its own lines, ending with the ``<|assistant|>`` header the answer follows."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    if not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages must be objects with 'role' and 'content'")
    turns = [{"role": str(m.get("role", "user")), "content": _text(m.get("content", ""))} for m in messages]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template may refuse roles or orders (jinja's raise_exception)
            raise ValueError(f"the chat template refused the messages: {e}") from None
    return "".join(DEFAULT_TEMPLATE.format(**t) for t in turns) + GENERATION_PROMPT


#: the name that asks for :data:`DEFAULT_TEMPLATE` where no served model gives its own
DEFAULT_TEMPLATE_NAME = "default"


@dataclass(frozen=True)
class ChatTemplate:
    """How chat rows become the prompt the gateway counts and predicts on: the served model's own
    template (its tokenizer's), or the documented default when asked for by name
    (``--chat-template default``: the project's own random models, which know no other). Neither:
    chat rows are refused, naming what to give (a real model must not get a template it was never
    trained on, nor be counted in another tokenizer)."""

    tokenizer: object = None  # the served model's tokenizer (None: no served model given)
    default: bool = False
    served: str = ""  # the served model's directory, for the message

    @classmethod
    def of(cls, tokenizer, name: str | None, served: str | None) -> ChatTemplate:
        """The template of a gateway or loadgen given ``--served-model`` (``served``, whose loaded
        ``tokenizer``) and ``--chat-template`` (``name``)."""
        if name not in (None, "", DEFAULT_TEMPLATE_NAME):
            raise ValueError(
                f"--chat-template {name!r}: the only template asked for by name is {DEFAULT_TEMPLATE_NAME!r}"
            )
        return cls(tokenizer if served else None, name == DEFAULT_TEMPLATE_NAME, served or "")

    def render(self, messages: list) -> str:
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            return render_chat(messages, self.tokenizer)
        if self.default:
            return render_chat(messages)
        where = (
            f"the served model {self.served} has no chat template"
            if self.served
            else "no served model was given"
        )
        raise ValueError(
            f"a chat row needs the served model's chat template, and {where}: give the served model's "
            f"directory (--served-model DIR, with its chat template) or ask for the documented default "
            f"by name (--chat-template {DEFAULT_TEMPLATE_NAME}: <|role|> headers)"
        )


#: the documented default, for callers that run the project's own models
DEFAULT_CHAT = ChatTemplate(default=True)


def _number(body: Mapping, key: str, default: float, field: str | None = None) -> float:
    """``body[key]`` checked against the range of the query's number ``field`` (default ``key``)."""
    value = body.get(key)
    if value is None:
        return default
    problem = number_problem(field or key, value, key)
    if problem:
        raise ValueError(problem)
    return value


def _utf8(text: str, what: str) -> str:
    """``text``, if it can be sent (JSON allows lone surrogates, which UTF-8 cannot carry)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{what} holds a lone surrogate (\\ud800-\\udfff), which is not text") from None
    return text


def parse_row(
    row, default_max_tokens: int = 0, template: ChatTemplate = DEFAULT_CHAT, endpoint: str | None = None
) -> OpenAIRequest:
    """One input line (parsed JSON) as a request; ``ValueError`` naming the field otherwise. A chat
    row's prompt is its messages rendered by ``template``.

    ``endpoint``: the batch's endpoint, which every line's ``url`` must match (absent: ``CHAT``)."""
    if not isinstance(row, dict):
        raise ValueError("a line must be a JSON object")
    url = row.get("url") or endpoint or CHAT
    if url not in ENDPOINTS:
        raise ValueError(f"endpoint {url!r} is not supported (supported: {', '.join(ENDPOINTS)})")
    if endpoint is not None and url != endpoint:
        raise ValueError(f"url {url!r} differs from the batch's endpoint {endpoint!r}")
    if row.get("method", "POST") != "POST":
        raise ValueError(f"method {row['method']!r} is not supported (POST only)")
    if "custom_id" not in row:
        raise ValueError("missing custom_id")
    body = row.get("body") or {}
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    check_body(body)
    if "messages" in body:
        prompt = template.render(body["messages"])
    elif "prompt" in body:
        raw = body["prompt"]
        if not (isinstance(raw, str) or (isinstance(raw, list) and all(isinstance(p, str) for p in raw))):
            raise ValueError("prompt must be a string or a list of strings")
        prompt = raw if isinstance(raw, str) else "\n".join(raw)
    else:
        raise ValueError("body needs 'messages' or 'prompt'")
    max_tokens = _number(body, "max_tokens", 0) or _number(body, "max_completion_tokens", 0, "max_tokens")
    seed = body.get("seed")
    kept = {k: body[k] for k in ("messages", "model", *fields_used(body)) if body.get(k) is not None}
    return OpenAIRequest(
        custom_id=_utf8(str(row["custom_id"]), "custom_id"),
        url=url,
        prompt=_utf8(prompt, "the prompt"),
        max_tokens=int(max_tokens) or default_max_tokens,
        temperature=float(_number(body, "temperature", 0.0)),
        top_p=float(_number(body, "top_p", 1.0)),
        seed=None if seed is None else int(_number(body, "seed", 0)),
        model=_utf8(str(body.get("model") or ""), "model"),
        openai_body=json.dumps(kept, ensure_ascii=False) if set(kept) - {"model"} else "",
    )


def _id(prefix: str, *parts: str) -> str:
    return prefix + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


#: the model an output line names where its request named none
DEFAULT_MODEL = "fleetbatch"


def output_line(result: Mapping, endpoint: str, model: str, custom_id: str | None = None) -> dict:
    """One request's line from its result (as the queue stores it, or ``fleetbatch loadgen submit`` writes it);
    ``model``: the one its request named ("": :data:`DEFAULT_MODEL`)."""
    batch_id = str(result.get("batch_id", ""))
    custom_id = str(result["query_id"]) if custom_id is None else custom_id
    reason = result.get("finish_reason") or ""
    line = {
        "id": _id("batch_req_", batch_id, custom_id),
        "custom_id": custom_id,
        "response": None,
        "error": None,
    }
    how = outcome(reason, result.get("error"))
    if not how.answered:
        code = (
            "server_error"
            if how is not Outcome.CANCELLED
            else "batch_expired"
            if reason == "batch_expired"
            else "cancelled"
        )
        line["error"] = {"code": code, "message": result.get("error") or f"request {reason}"}
        return line
    prompt, completion = int(result.get("prompt_tokens") or 0), int(result.get("completion_tokens") or 0)
    created = int(float((result.get("timings") or {}).get("finished_at") or 0))
    finish = "length" if how is Outcome.TRUNCATED else "stop"
    # what an endpoint answered beyond the text (workqueue.openai_body.EXTRA_ANSWERS; JSON on the gRPC wire)
    raw = result.get("openai_extra") or {}
    extra = {
        k: v for k, v in (json.loads(raw) if isinstance(raw, str) else raw).items() if k in EXTRA_ANSWERS
    }
    logprobs = extra.get("logprobs")
    if endpoint == COMPLETIONS:
        body = {
            "object": "text_completion",
            "choices": [
                {"index": 0, "text": result.get("text", ""), "logprobs": logprobs, "finish_reason": finish}
            ],
        }
    else:
        message = {"role": "assistant", "content": result.get("text", "")}
        if extra.get("tool_calls"):
            message["tool_calls"] = extra["tool_calls"]
            finish = "tool_calls" if finish == "stop" else finish
        body = {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
        }
    body = {
        "id": _id("cmpl-" if endpoint == COMPLETIONS else "chatcmpl-", batch_id, custom_id),
        "created": created,
        "model": model or DEFAULT_MODEL,
        **body,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    line["response"] = {"status_code": 200, "request_id": _id("req_", batch_id, custom_id), "body": body}
    return line
