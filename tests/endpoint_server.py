"""A real ``transformers serve`` for the endpoint backend's tests, on a small local chat model.

:func:`chat_model_dir` builds (once per test session, under pytest's base temp) a Llama of random
weights saved by ``transformers`` with a tokenizer trained here whose chat template has turn tokens,
a BOS and another shape than the gateway's default template (:mod:`localmodels.chat_model`).
:class:`EndpointServer` (:mod:`load.endpoint_server`) runs ``transformers serve MODEL_DIR`` on a free
loopback port as a real process (CPU), waits until it answers ``/health``, and stops or kills it by
its pid; it can start again on the same port.

:func:`byte_model_dir` builds a model whose text round-trips: a tokenizer of single bytes (no merges) and a
generation config that suppresses every token but the ASCII bytes and the end of text (and a chat template of
plain-text turns), so the text of any
answer tokenizes back to the very tokens generated (a continuation from the text can then equal the
uninterrupted answer token for token: the seam costs nothing).
"""

from __future__ import annotations

from pathlib import Path

from load.endpoint_server import EndpointServer, endpoint_server, free_port
from localmodels.chat_model import CHAT_TEMPLATE, TURN_TOKENS, build_chat_model

MODEL_DIR_NAME = "endpoint-chat-model"
BYTE_MODEL_DIR_NAME = "endpoint-byte-model"
#: the byte model's chat template: its start token, then plain-text turns
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

__all__ = [
    "CHAT_TEMPLATE",
    "MODEL_DIR_NAME",
    "TURN_TOKENS",
    "EndpointServer",
    "build_chat_model",
    "byte_model_dir",
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


def byte_model_dir(tmp_path_factory) -> Path:
    """The byte model's directory (module docstring), built once per session (per pytest-xdist worker)."""
    path = tmp_path_factory.getbasetemp() / BYTE_MODEL_DIR_NAME
    if (path / "config.json").exists():
        return path
    from localmodels.build import build_model
    from localmodels.tokenizer import generated_corpus, train_tokenizer

    tok = train_tokenizer(generated_corpus(n=50), vocab_size=260)  # the 256 bytes and 4 special tokens
    assert len(tok) == 260, len(tok)
    tok.chat_template = BYTE_CHAT_TEMPLATE
    model = build_model("llama", "nano", tokenizer=tok, max_positions=1024)
    keep = {i for i in range(len(tok)) if len(text := tok.decode([i])) == 1 and text.isascii()}
    model.generation_config.suppress_tokens = sorted(set(range(len(tok))) - keep - {tok.eos_token_id})
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)
    return path
