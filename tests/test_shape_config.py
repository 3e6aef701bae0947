"""The planner's model configs without transformers (quant.shape_config): every figure the accounting gives equals
the one it gives on the Hugging Face config they stand for, and the planner's CLI imports neither torch nor
transformers (``fleetbatch planner fleet`` runs under every ``fleetbatch gateway up --fleet``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import GPT2Config, LlamaConfig, OPTConfig

from localmodels import SIZES
from planner.modelshape import load_shape
from quant import accounting, configs
from quant.omega import synthetic_indicator
from quant.shape_config import ShapeConfig
from tests.harness import REPO

_OPT = {"opt-125m": (768, 12, 12, 3072), "opt-13b": (5120, 40, 40, 20480), "opt-66b": (9216, 64, 72, 36864)}
_LLAMA = {"llama-2-70b": (8192, 80, 64, 8, 28672, 32000), "llama-3-8b": (4096, 32, 32, 8, 14336, 128256)}


def _hf_named(name: str):
    """The Hugging Face config a table name stood for before (the classes' own defaults for the rest)."""
    if name in _OPT:
        h, n, heads, ffn = _OPT[name]
        return OPTConfig(
            hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, ffn_dim=ffn, word_embed_proj_dim=h,
            vocab_size=50272,
        )  # fmt: skip
    h, n, heads, kv, inter, vocab = _LLAMA[name]
    return LlamaConfig(
        hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv,
        intermediate_size=inter, vocab_size=vocab,
    )  # fmt: skip


def _hf_local(arch: str, size: str):
    """The config ``localmodels.build_model`` builds for ``arch:size`` (vocabulary 8192, 2048 positions)."""
    hidden, layers, heads, kv, inter = SIZES[size]
    if arch == "llama":
        return LlamaConfig(
            vocab_size=8192, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048, tie_word_embeddings=False,
        )  # fmt: skip
    if arch == "gpt2":
        return GPT2Config(vocab_size=8192, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=2048)
    return OPTConfig(
        vocab_size=8192, hidden_size=hidden, ffn_dim=inter, num_hidden_layers=layers, num_attention_heads=heads,
        max_position_embeddings=2048, word_embed_proj_dim=hidden,
    )  # fmt: skip


def _figures(config) -> dict:
    return {
        "family": accounting.model_family(config),
        "head_dim": accounting.head_dim(config),
        "kv_heads": accounting.num_kv_heads(config),
        "linears": accounting.layer_linear_shapes(config),
        "biases": accounting.layer_linear_biases(config),
        "norm_bytes": accounting.layer_norm_bytes(config),
        "layer_bytes": {b: accounting.decoder_layer_weight_bytes(config, b) for b in (16, 8, 4, 3)},
        "kv_bytes": {b: accounting.kv_bytes_per_token(config, b) for b in (16, 8, 4)},
        "non_layer_bytes": accounting.non_layer_weight_bytes(config),
        "omega": synthetic_indicator(config, seed=3),
    }


CASES = [("named", n) for n in (*_OPT, *_LLAMA)] + [
    ("local", f"{arch}:{size}") for arch in ("llama", "gpt2", "opt") for size in ("nano", "tiny")
]


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_the_light_config_gives_every_figure_of_the_hugging_face_one(kind, name):
    light = configs.named_config(name) if kind == "named" else load_shape(name).config
    hf = _hf_named(name) if kind == "named" else _hf_local(*name.split(":"))
    assert isinstance(light, ShapeConfig)
    assert _figures(light) == _figures(hf)
    # and back to Hugging Face (the profiler and the fidelity check build models from it): the same config
    assert _figures(light.to_hf()) == _figures(hf)
    assert type(light.to_hf()) is type(hf)
    assert light.to_hf().to_dict() == hf.to_dict()


def test_a_config_file_is_read_with_its_class_defaults(tmp_path):
    """A user's config.json leaves its class's defaults out: those come from transformers, as before."""
    path = tmp_path / "config.json"
    path.write_text(_hf_local("opt", "tiny").to_json_string(use_diff=True))
    shape = load_shape(str(path))
    assert _figures(shape.config) == _figures(_hf_local("opt", "tiny"))
    assert shape.hf_config() is shape.config


def test_the_planner_cli_imports_neither_torch_nor_transformers():
    code = "import sys, planner.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"
