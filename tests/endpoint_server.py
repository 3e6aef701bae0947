"""A real ``transformers serve`` for the endpoint backend's tests, on a small local chat model.

:func:`chat_model_dir` builds (once per test session, under pytest's base temp) a Llama of random
weights saved by ``transformers`` with a tokenizer trained here whose chat template has turn tokens,
a BOS and another shape than the gateway's default template. :class:`EndpointServer` runs
``transformers serve MODEL_DIR`` on a free loopback port as a real process (CPU), waits until it
answers ``/health``, and stops or kills it by its pid; it can start again on the same port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

#: the chat template: BOS, turns between special tokens (the gateway's default is "<|role|>\ncontent\n")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TURN_TOKENS = ["<|im_start|>", "<|im_end|>"]
MODEL_DIR_NAME = "endpoint-chat-model"


def chat_model_dir(tmp_path_factory) -> Path:
    """The chat model's directory, built once per session (per pytest-xdist worker)."""
    path = tmp_path_factory.getbasetemp() / MODEL_DIR_NAME
    if not (path / "config.json").exists():
        build_chat_model(path)
    return path


def build_chat_model(path: Path) -> Path:
    """Save a llama:nano of random weights and its chat tokenizer to ``path``."""
    from localmodels import build_model, generated_corpus, train_tokenizer

    tok = train_tokenizer(generated_corpus(n=800), vocab_size=1024)
    tok.add_tokens(TURN_TOKENS, special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    model = build_model("llama", "nano", tokenizer=tok, max_positions=1024)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class EndpointServer:
    """``transformers serve`` of one model directory on 127.0.0.1 (see the module's docstring)."""

    def __init__(self, model_dir: Path, log_dir: Path, *extra: str) -> None:
        self.model_dir, self.log_dir, self.extra = model_dir, log_dir, extra
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        """The OpenAI base URL."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def model(self) -> str:
        """The model's name at the server (the directory it was given)."""
        return str(self.model_dir)

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"transformers-serve-{self.port}.log"

    def start(self, timeout_s: float = 240) -> str:
        """Start the server and wait until it answers; returns its base URL."""
        self.starts += 1
        cmd = [
            str(Path(sys.executable).with_name("transformers")), "serve", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--dtype", "float32",
            "--log-level", "warning", *self.extra,
        ]  # fmt: skip
        env = dict(
            os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
        )  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while not _answers(self.url.removesuffix("/v1") + "/health"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited ({self.proc.returncode}): {self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(
                    f"transformers serve did not answer in {timeout_s:.0f} s: {self.log_tail()}"
                )
            time.sleep(0.2)
        return self.url

    def kill(self) -> None:
        """SIGKILL the server by its pid (as a crash would end it) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s, by its pid."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


@contextlib.contextmanager
def endpoint_server(model_dir: Path, log_dir: Path, *extra: str) -> Iterator[EndpointServer]:
    """A started :class:`EndpointServer`, stopped at the end."""
    server = EndpointServer(model_dir, log_dir, *extra)
    server.start()
    try:
        yield server
    finally:
        server.stop()
