"""OpenAI Batch output: the results of a batch as the ``openai`` client and other tools read them.

One line per request. A request that succeeded has ``response`` (``status_code`` 200,
``request_id`` and a ``body``: a ``chat.completion`` for ``/v1/chat/completions``, a
``text_completion`` for ``/v1/completions``, with ``choices`` and ``usage``) and ``error`` null;
it goes to the output file. A request that failed or was cancelled has ``response`` null and
``error`` (``code``, ``message``) and goes to the error file, as OpenAI's batches do.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)


#: body fields that are honoured or change nothing about the answer
ACCEPTED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
            "seed", "user", "metadata", "store", "stream", "n", "stop"}  # fmt: skip

#: the documented default chat template, for serving tokenizers without one
DEFAULT_TEMPLATE = "<|{role}|>\n{content}\n"
GENERATION_PROMPT = "<|assistant|>\n"


def check_body(body: dict) -> None:
    """Refuse what the engines cannot honour, naming it: other fields, ``n`` > 1, ``stop``, streaming."""
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise ValueError(f"body fields not supported: {', '.join(unknown)}")
    if body.get("n", 1) != 1:
        raise ValueError(f"n={body['n']} is not supported (one choice per request)")
    if body.get("stop"):
        raise ValueError("stop sequences are not supported; remove 'stop'")
    if body.get("stream"):
        raise ValueError("stream=true has no meaning in a batch")


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text is supported
        kinds = sorted({p.get("type", "?") for p in content if isinstance(p, dict)} - {"text"})
        if kinds:
            raise ValueError(f"message content of type {', '.join(kinds)} is not supported (text only)")
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise ValueError(
        f"message content must be a string or a list of text parts, not {type(content).__name__}"
    )


def render_chat(messages: list, tokenizer=None) -> str:
    """One prompt from chat messages: the tokenizer's chat template when it has one, else
    ``<|role|>`` headers (``<|system|>``, ``<|user|>``, ``<|assistant|>``) with each message on
    its own lines, ending with the ``<|assistant|>`` header the answer follows."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    turns = [{"role": str(m.get("role", "user")), "content": _text(m.get("content", ""))} for m in messages]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return "".join(DEFAULT_TEMPLATE.format(**t) for t in turns) + GENERATION_PROMPT


def endpoints_of(input_path: str | Path) -> dict[str, str]:
    """``custom_id -> url`` of an OpenAI batch input file (``/v1/chat/completions`` when absent)."""
    out = {}
    for line in Path(input_path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            out[str(row["custom_id"])] = row.get("url") or CHAT
    return out


def _id(prefix: str, *parts: str) -> str:
    return prefix + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def output_line(result: Mapping, endpoint: str, model: str) -> dict:
    """One request's line (the result as ``loadgen submit`` writes it)."""
    batch_id, custom_id = str(result.get("batch_id", "")), str(result["query_id"])
    reason = result.get("finish_reason") or ""
    line = {
        "id": _id("batch_req_", batch_id, custom_id),
        "custom_id": custom_id,
        "response": None,
        "error": None,
    }
    if reason in ("error", "cancelled", "abort") or result.get("error"):
        code = "cancelled" if reason in ("cancelled", "abort") else "server_error"
        line["error"] = {"code": code, "message": result.get("error") or f"request {reason}"}
        return line
    prompt, completion = int(result.get("prompt_tokens") or 0), int(result.get("completion_tokens") or 0)
    created = int(float((result.get("timings") or {}).get("finished_at") or 0))
    finish = "stop" if reason == "stop" else "length"
    if endpoint == COMPLETIONS:
        body = {
            "object": "text_completion",
            "choices": [
                {"index": 0, "text": result.get("text", ""), "logprobs": None, "finish_reason": finish}
            ],
        }
    else:
        message = {"role": "assistant", "content": result.get("text", "")}
        body = {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        }
    body = {
        "id": _id("cmpl-" if endpoint == COMPLETIONS else "chatcmpl-", batch_id, custom_id),
        "created": created,
        "model": model,
        **body,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    line["response"] = {"status_code": 200, "request_id": _id("req_", batch_id, custom_id), "body": body}
    return line


def error_path(output: str | Path) -> Path:
    p = Path(output)
    return p.with_name(p.stem + "_errors" + (p.suffix or ".jsonl"))


def write_openai_output(
    results: Iterable[Mapping], endpoints: Mapping[str, str], output: str | Path, model: str = "fleetbatch"
) -> tuple[int, int]:
    """Write the output and error files; returns (lines written to each)."""
    ok, bad = 0, 0
    with open(output, "w", encoding="utf-8") as out, open(error_path(output), "w", encoding="utf-8") as err:
        for r in results:
            line = output_line(r, endpoints.get(str(r["query_id"]), CHAT), model)
            target = err if line["error"] else out
            target.write(json.dumps(line, ensure_ascii=False) + "\n")
            ok, bad = (ok, bad + 1) if line["error"] else (ok + 1, bad)
    return ok, bad
