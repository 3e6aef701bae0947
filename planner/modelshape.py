"""Model shapes for planning: the essentials of a Hugging Face decoder config.

Accepts named shapes (``opt-13b``, ``opt-30b``, ``opt-66b``, ``llama-7b`` ...), the local
``localmodels`` sizes (``llama:tiny``), or a path to a ``config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localmodels import sizes as lm
from quant import accounting, configs
from quant.shape_config import ShapeConfig, gpt2_config, llama_config, opt_config


@dataclass(frozen=True)
class ModelShape:
    """The shape essentials of a decoder config (read once: HF config attribute access is slow)."""

    name: str
    config: Any = field(compare=False, repr=False)  # a ShapeConfig, or a Hugging Face config read from a file
    family: str = field(init=False)
    hidden: int = field(init=False)
    layers: int = field(init=False)
    heads: int = field(init=False)
    kv_heads: int = field(init=False)
    head_dim: int = field(init=False)
    intermediate: int = field(init=False)
    vocab: int = field(init=False)

    def __post_init__(self) -> None:
        c = self.config
        fam = accounting.model_family(c)
        gpt2 = fam == "gpt2"
        hidden = int(c.n_embd if gpt2 else c.hidden_size)
        if gpt2:
            inter = int(c.n_inner or 4 * hidden)
        elif fam == "opt":
            inter = int(c.ffn_dim)
        else:
            inter = int(c.intermediate_size)
        values = {
            "family": fam,
            "hidden": hidden,
            "layers": int(c.n_layer if gpt2 else c.num_hidden_layers),
            "heads": int(c.n_head if gpt2 else c.num_attention_heads),
            "kv_heads": accounting.num_kv_heads(c),
            "head_dim": accounting.head_dim(c),
            "intermediate": inter,
            "vocab": int(c.vocab_size),
        }
        for k, v in values.items():
            object.__setattr__(self, k, v)

    def hf_config(self) -> Any:
        """The Hugging Face config, for building the model (imports transformers)."""
        return self.config.to_hf() if isinstance(self.config, ShapeConfig) else self.config

    @property
    def gated_mlp(self) -> bool:
        return self.family == "llama"

    def layer_params(self) -> int:
        """Weights of the linear operators of one decoder layer (elements)."""
        return sum(i * o for _, i, o in accounting.layer_linear_shapes(self.config))

    def essentials(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "hidden": self.hidden,
            "layers": self.layers,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "intermediate": self.intermediate,
            "vocab": self.vocab,
        }


def shape_from_config(config: Any, name: str | None = None) -> ModelShape:
    accounting.model_family(config)  # raises for unsupported configs
    return ModelShape(name or getattr(config, "name_or_path", "") or config.model_type, config)


def load_shape(spec: str) -> ModelShape:
    """``opt-13b`` / ``llama3-8b`` / ``llama:tiny`` (localmodels) / path to a config.json or model dir."""
    key = spec.strip()
    if configs.canonical_name(key):  # the shared table of public model shapes
        return ModelShape(key.lower(), configs.named_config(key))
    p = Path(key)
    if p.exists():
        cfg_path = p / "config.json" if p.is_dir() else p
        try:
            d = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read model config {cfg_path}: {e}") from None
        mt = d.get("model_type")
        if not mt:
            raise ValueError(f"{cfg_path} has no model_type")
        # a user's model: its class's defaults (transformers) fill what the file leaves out
        from transformers import AutoConfig

        cfg = AutoConfig.for_model(mt, **{k: v for k, v in d.items() if k != "model_type"})
        return shape_from_config(cfg, p.stem if not p.is_dir() else p.name)
    if ":" in key:
        arch, size = key.split(":", 1)
        if arch not in lm.ARCHS or size not in lm.SIZES:
            raise ValueError(f"unknown local model {key!r}; archs {lm.ARCHS}, sizes {tuple(lm.SIZES)}")
        hidden, layers, heads, kv_heads, inter = lm.SIZES[size]
        return ModelShape(key, local_config(arch, hidden, layers, heads, kv_heads, inter))
    known = ", ".join(configs.NAMES + tuple(configs.ALIASES))
    raise ValueError(
        f"unknown model {spec!r}: use one of {known}, 'arch:size' (localmodels) or a config.json path"
    )


def local_config(
    arch: str, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int = 8192
) -> ShapeConfig:
    """A config like ``localmodels.build_model`` makes (same shapes)."""
    if arch == "llama":
        return llama_config(hidden, layers, heads, kv_heads, inter, vocab)
    if arch == "gpt2":
        return gpt2_config(hidden, layers, heads, vocab, max_positions=2048)
    return opt_config(hidden, layers, heads, inter, vocab)
