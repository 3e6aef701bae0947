"""Build tokenizers and small decoder models locally; load real ones from a directory."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from localmodels.paths import CACHE_ENV, cache_dir  # noqa: F401  (known from here too)
from localmodels.sizes import ARCHS, SIZES  # noqa: F401  (known from here too)
from localmodels.tokenizer import (  # noqa: F401  (known from here too)
    SPECIAL,
    default_corpus,
    default_tokenizer,
    generated_corpus,
    train_tokenizer,
)

log = logging.getLogger(__name__)


def build_model(
    arch: str = "llama",
    size: str = "tiny",
    vocab_size: int = 8192,
    max_positions: int = 2048,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """A decoder of a real architecture with random (seeded) weights."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    hidden, layers, heads, kv_heads, inter = SIZES[size]
    ids = {}
    if tokenizer is not None:
        vocab_size = len(tokenizer)
        ids = dict(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=False,
            **ids,
        )
        model = LlamaForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(
            vocab_size=vocab_size,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=max_positions,
            **ids,
        )
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = OPTConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            ffn_dim=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            max_position_embeddings=max_positions,
            word_embed_proj_dim=hidden,
            **ids,
        )
        model = OPTForCausalLM(cfg)
    return model.to(dtype).eval()


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """Load a real Hugging Face causal LM and its tokenizer from a local directory (no downloads)."""
    p = Path(path)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"{p} is not a Hugging Face model directory (no config.json)")
    tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True, dtype=dtype)
    return model.eval(), tok


def load_or_build(
    model_dir: str | os.PathLike | None = None,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """``(model, tokenizer)``: from ``model_dir`` when given, else a random ``arch``/``size`` model with the default tokenizer."""
    if model_dir:
        return load_model(model_dir, dtype)
    tok = default_tokenizer()
    return build_model(arch, size, seed=seed, tokenizer=tok, dtype=dtype), tok
