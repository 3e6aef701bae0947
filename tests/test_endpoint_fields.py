"""OpenAI fields passed through to an endpoint and what they bring back, against a stub endpoint that
records what it receives (tests/stub_endpoint.py; ``transformers serve`` ignores these fields): a chat
row goes to /v1/chat/completions with its own messages and fields, its log-probabilities and tool
call (streamed in pieces) are kept in the result and reach the OpenAI output line."""

from __future__ import annotations

import json

from engines.endpoint_backend import EndpointEngine
from engines.endpoint_settings import EndpointSettings
from engines.interface import Request, SamplingParams
from gateway.http_api.format import CHAT, output_line, parse_row
from tests.harness import wait_until
from tests.stub_endpoint import StubEndpoint
from workqueue.records import QueryResult

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"}]


def test_a_chat_rows_messages_and_fields_reach_the_endpoint_and_its_answers_the_output_line():
    row = {
        "custom_id": "r1",
        "url": CHAT,
        "body": {
            "model": "m",
            "messages": MESSAGES,
            "max_tokens": 16,
            "tools": TOOLS,
            "tool_choice": "auto",
            "logprobs": True,
            "top_logprobs": 2,
            "response_format": {"type": "json_object"},
            "stop": ["\n\n"],
            "seed": 7,
        },
    }
    parsed = parse_row(row)
    body = json.loads(parsed.openai_body)
    assert body == {k: row["body"][k] for k in body} and "max_tokens" not in body and "seed" not in body
    with StubEndpoint() as stub:
        engine = EndpointEngine(EndpointSettings(urls=(stub.url,), model="served-name"))
        try:
            sampling = SamplingParams(max_tokens=16, seed=7)
            engine.add_request(Request("r1", parsed.prompt, sampling, openai_body=body))
            (out,) = wait_until(engine.step, 60, "the output")
        finally:
            engine.close()
    ((path, sent),) = stub.bodies
    assert path == "/v1/chat/completions" and sent["messages"] == MESSAGES and "prompt" not in sent
    assert sent["model"] == "served-name"  # the name the endpoint knows, not the row's
    for name in ("tools", "tool_choice", "logprobs", "top_logprobs", "response_format", "stop"):
        assert sent[name] == row["body"][name], name
    assert (sent["max_tokens"], sent["seed"], sent["stream"]) == (16, 7, True)
    assert (out.text, out.finish_reason, out.prompt_tokens, out.completion_tokens) == (
        "Looking",
        "tool_calls",
        11,
        7,
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    assert out.openai_extra == {"logprobs": {"content": [
        {"token": "Look", "logprob": -0.5, "top_logprobs": []}, {"token": "ing", "logprob": -0.25, "top_logprobs": []},
    ]}, "tool_calls": [call]}  # fmt: skip
    result = QueryResult("b", "r1", text=out.text, prompt_tokens=11, completion_tokens=7,
                         finish_reason="stop", openai_extra=out.openai_extra)  # fmt: skip
    line = output_line(json.loads(result.to_json()), CHAT, "m")
    choice = line["response"]["body"]["choices"][0]
    assert choice["message"]["tool_calls"] == [call] and choice["finish_reason"] == "tool_calls"
    assert choice["logprobs"] == out.openai_extra["logprobs"]


def test_a_text_row_goes_to_completions_with_its_prompt_and_fields():
    parsed = parse_row({"custom_id": "t", "url": "/v1/completions", "body": {"prompt": "Once", "logprobs": 2}},
                       endpoint="/v1/completions")  # fmt: skip
    with StubEndpoint() as stub:
        engine = EndpointEngine(EndpointSettings(urls=(stub.url,), model="m"))
        try:
            engine.add_request(Request("t", parsed.prompt, SamplingParams(max_tokens=4),
                                       openai_body=json.loads(parsed.openai_body)))  # fmt: skip
            wait_until(engine.step, 60, "the output")
        finally:
            engine.close()
    ((path, sent),) = stub.bodies
    assert path == "/v1/completions" and sent["prompt"] == "Once" and sent["logprobs"] == 2
    assert "messages" not in sent
