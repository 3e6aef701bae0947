"""A local chat model for OpenAI-compatible servers (``transformers serve``): a Llama of random weights
saved with a tokenizer whose chat template has turn tokens, a BOS and another shape than the gateway's
default template (``<|role|>`` headers), so a prompt-token count checked against a server's
``usage.prompt_tokens`` means something. The endpoint backend's tests and ``fleetbatch loadgen
endpoints`` serve it."""

from __future__ import annotations

from pathlib import Path

#: the chat template: BOS, turns between special tokens (the gateway's default is "<|role|>\ncontent\n")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TURN_TOKENS = ["<|im_start|>", "<|im_end|>"]


def build_chat_model(
    path: Path,
    size: str = "nano",
    *,
    vocab_size: int = 1024,
    corpus: list[str] | None = None,
    max_positions: int = 1024,
    seed: int = 0,
) -> Path:
    """Save a ``llama:size`` of random (seeded) weights and its chat tokenizer (BPE of ``vocab_size``
    trained on ``corpus``, generated text by default) to ``path``, atomically (a temporary directory renamed)."""
    from localmodels.build import build_model, generated_corpus, train_tokenizer

    tok = train_tokenizer(corpus if corpus is not None else generated_corpus(n=800), vocab_size=vocab_size)
    tok.add_tokens(TURN_TOKENS, special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    model = build_model("llama", size, tokenizer=tok, max_positions=max_positions, seed=seed)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)
    return path
