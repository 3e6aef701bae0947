"""A real ``transformers serve`` for the endpoint backend's tests, on a small local chat model.

:func:`chat_model_dir` builds (once per test session, under pytest's base temp) a Llama of random
weights saved by ``transformers`` with a tokenizer trained here whose chat template has turn tokens,
a BOS and another shape than the gateway's default template (:mod:`localmodels.chat_model`).
:class:`EndpointServer` (:mod:`load.endpoint_server`) runs ``transformers serve MODEL_DIR`` on a free
loopback port as a real process (CPU), waits until it answers ``/health``, and stops or kills it by
its pid; it can start again on the same port.
"""

from __future__ import annotations

from pathlib import Path

from load.endpoint_server import EndpointServer, endpoint_server, free_port
from localmodels.chat_model import CHAT_TEMPLATE, TURN_TOKENS, build_chat_model

MODEL_DIR_NAME = "endpoint-chat-model"

__all__ = [
    "CHAT_TEMPLATE",
    "MODEL_DIR_NAME",
    "TURN_TOKENS",
    "EndpointServer",
    "build_chat_model",
    "chat_model_dir",
    "endpoint_server",
    "free_port",
]


def chat_model_dir(tmp_path_factory) -> Path:
    """The chat model's directory, built once per session (per pytest-xdist worker)."""
    path = tmp_path_factory.getbasetemp() / MODEL_DIR_NAME
    if not (path / "config.json").exists():
        build_chat_model(path)
    return path
