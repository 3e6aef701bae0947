"""The OpenAI request a query carries beside its prompt (``Query.openai_body``): one place for its rules.

A row of an OpenAI batch file, or a gRPC query that sets ``openai_body``, keeps the request it came
from as a JSON object: a chat row's ``messages`` and the OpenAI fields an endpoint backend passes
through to the inference server (:data:`PASS_THROUGH`). The gateway still counts, limits and
predicts on the query's ``prompt`` (the chat rendered with the served model's template); an
endpoint backend sends the chat's own messages to ``/v1/chat/completions`` and the fields as
given, and keeps what they bring back beyond the text (:data:`EXTRA_ANSWERS`) in the result.

A backend that runs ``prompt`` itself (native, static, vLLM in process) honours none of the
fields: a cluster says which it honours when it registers (``openai_fields``), and the gateway
refuses at submission a row whose fields some cluster that could run it cannot honour.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

#: OpenAI request fields passed through to an endpoint as the row gives them
PASS_THROUGH = frozenset(
    {
        "response_format",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "stop",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
    }
)
#: what a row's ``openai_body`` may hold: the chat, the model's name and the fields passed through
BODY_FIELDS = PASS_THROUGH | {"messages", "model"}
#: the fields passed through that a continuation from the text (``/v1/completions`` with the prompt and the
#: partial output's text, :mod:`workqueue.partial`) honours as the whole answer would: a row with any other (a
#: schema, log-probabilities, tools; the penalties, which count the answer's tokens and would not count the
#: partial text, now prompt) runs again from the start when it resumes elsewhere. A stop string across the seam
#: is found by the engine (engines.endpoint_job)
CONTINUABLE = frozenset({"stop", "logit_bias"})
#: passed-through fields whose zero is no request at all (a client's default): they do not stop a continuation
_ZERO_IS_NONE = ("frequency_penalty", "presence_penalty")
#: what an endpoint answers beyond the text that the result keeps (``QueryResult.openai_extra``)
EXTRA_ANSWERS = ("logprobs", "tool_calls")
#: the largest ``openai_body`` (JSON bytes) a query may carry: a long chat, tools and a schema
MAX_BODY_BYTES = 1024 * 1024


def parse_body(raw: str) -> dict:
    """``raw`` (a query's ``openai_body``) as a dict (empty: ``{}``); ``ValueError`` naming the problem."""
    if not raw:
        return {}
    if len(raw) > MAX_BODY_BYTES:
        raise ValueError(f"openai_body has {len(raw)} characters; the limit is {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"openai_body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ValueError("openai_body must be a JSON object")
    unknown = sorted(set(body) - BODY_FIELDS)
    if unknown:
        raise ValueError(
            f"openai_body fields not supported: {', '.join(unknown)} "
            f"(supported: {', '.join(sorted(BODY_FIELDS))})"
        )
    messages = body.get("messages")
    if messages is not None and (
        not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages)
    ):
        raise ValueError("openai_body's messages must be a non-empty list of objects")
    return body


def fields_used(body: Mapping) -> list[str]:
    """The fields of ``body`` passed through (what a backend must honour to run the row), sorted."""
    return sorted(k for k in body if k in PASS_THROUGH and body[k] is not None)


def unhonoured(body: Mapping, honoured: Iterable[str]) -> list[str]:
    """The fields of ``body`` that a backend honouring ``honoured`` cannot run, sorted."""
    have = set(honoured)
    return [f for f in fields_used(body) if f not in have]


def continuable(body: Mapping) -> bool:
    """Whether a continuation from the partial text can give the row's whole answer (:data:`CONTINUABLE`): it asks
    for nothing else (a penalty of 0 asks for nothing), and a chat's contents are plain strings (servers join a
    content's text parts differently: the rendering could not be the server's)."""
    asked = {k: v for k, v in body.items() if not (k in _ZERO_IS_NONE and not v)}
    messages = body.get("messages") or []
    return not unhonoured(asked, CONTINUABLE) and all(
        isinstance(m.get("content", ""), str | None) for m in messages if isinstance(m, dict)
    )


def encode_fields(fields: Iterable[str]) -> str:
    """A cluster's honoured fields as its registration stores them (``openai_fields``)."""
    return ",".join(sorted(fields))


def decode_fields(raw: str | None) -> frozenset[str]:
    return frozenset(f for f in (raw or "").split(",") if f)
