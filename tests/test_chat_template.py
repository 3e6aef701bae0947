"""The served model is the one source of a chat row's template: a chat row with neither the served
model's template nor the documented default asked for by name is refused, naming what to give;
``gateway up`` asks for the default only when its engines run the project's own random models."""

from __future__ import annotations

import json

import pytest

from clusterfile import Cluster
from gateway.deploy.up import gateway_config
from gateway.http_api.batches import InvalidFile, scan_input
from gateway.http_api.format import CHAT, DEFAULT_CHAT, ChatTemplate, parse_row
from localmodels import default_tokenizer

CHAT_ROW = {"custom_id": "c", "body": {"messages": [{"role": "user", "content": "Hi"}]}}
TEXT_ROW = {"custom_id": "t", "body": {"prompt": "Hi"}}


def test_a_chat_row_without_a_template_is_refused_naming_what_to_give():
    with pytest.raises(
        ValueError, match=r"no served model was given: give .*--served-model DIR.*--chat-template default"
    ):
        parse_row(CHAT_ROW, template=ChatTemplate.of(None, None, None))
    assert (
        parse_row(TEXT_ROW, template=ChatTemplate.of(None, None, None), endpoint="/v1/completions").prompt
        == "Hi"
    )
    tok = default_tokenizer()  # the project's tokenizer has no chat template of its own
    with pytest.raises(ValueError, match="the served model /m has no chat template"):
        parse_row(CHAT_ROW, template=ChatTemplate.of(tok, None, "/m"))
    assert (
        parse_row(CHAT_ROW, template=ChatTemplate.of(tok, "default", "/m")).prompt
        == "<|user|>\nHi\n<|assistant|>\n"
    )
    assert parse_row(CHAT_ROW, template=DEFAULT_CHAT).prompt == "<|user|>\nHi\n<|assistant|>\n"
    with pytest.raises(ValueError, match="--chat-template 'chatml'"):
        ChatTemplate.of(None, "chatml", None)


def test_the_http_front_names_the_line_of_a_chat_row_it_cannot_render():
    lines = [json.dumps(TEXT_ROW).encode(), json.dumps(CHAT_ROW).encode()]
    with pytest.raises(InvalidFile) as e:
        scan_input(lines, CHAT, ChatTemplate.of(None, None, None))
    assert [
        (x.line, "a chat row needs the served model's chat template" in x.message) for x in e.value.errors
    ] == [(2, True)]


def _args(**kw):
    from gateway.cli import build_parser

    args = build_parser().parse_args(["up"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize(
    ("cluster", "served_model", "template"),
    [
        (Cluster(name="a"), None, "default"),  # the project's random model: its own (default) template
        (
            Cluster(name="a", engine_args=["--served-model", "/m"]),
            None,
            "",
        ),  # a real model, not named to the gateway
        (Cluster(name="a", backend="endpoint", endpoints=["http://h:8000/v1"]), None, ""),  # a user's server
        (Cluster(name="a"), "/m", ""),  # the gateway counts in the served model's tokenizer
    ],
)
def test_gateway_up_asks_for_the_default_only_for_the_projects_own_models(cluster, served_model, template):
    config = gateway_config(_args(served_model=served_model), "redis://x", "t", [cluster])
    assert config.chat_template == template
