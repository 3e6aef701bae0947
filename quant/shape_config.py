"""A decoder's config as the accounting reads it (:mod:`quant.accounting`): the fields of a Hugging Face config of
the Llama, OPT or GPT-2 family, with those classes' defaults, held as plain attributes. Building one imports
nothing: ``transformers`` imports torch (about 3 s of CPU a process), which the planner, ``fleetbatch planner
fleet`` under ``fleetbatch gateway up`` included, does without. :meth:`ShapeConfig.to_hf` gives the Hugging Face
config for the code that builds a model from it (the planner's profiler and fidelity checks)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

#: the common names a family's Hugging Face config answers for its own (``GPT2Config.attribute_map``)
ATTRIBUTE_MAP = {
    "gpt2": {
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "max_position_embeddings": "n_positions",
    }
}


class ShapeConfig(SimpleNamespace):
    """The fields of a decoder config (``model_type`` and the shape), read as attributes like a Hugging Face one,
    the family's common names (:data:`ATTRIBUTE_MAP`) included."""

    model_type: str

    def __getattr__(self, name: str) -> Any:  # only for a name that is not a field
        field = ATTRIBUTE_MAP.get(vars(self).get("model_type", ""), {}).get(name)
        if field is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(self, field)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def to_hf(self) -> Any:
        """The same config as a Hugging Face ``PretrainedConfig`` (imports transformers)."""
        from transformers import AutoConfig

        fields = self.to_dict()
        return AutoConfig.for_model(fields.pop("model_type"), **fields)


def llama_config(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    max_positions: int = 2048,
) -> ShapeConfig:
    """A Llama-family decoder (gated MLP, RMSNorm, no biases, untied head: ``LlamaConfig``'s defaults)."""
    return ShapeConfig(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )


def opt_config(
    hidden: int, layers: int, heads: int, ffn: int, vocab: int, max_positions: int = 2048
) -> ShapeConfig:
    """An OPT decoder (biases, LayerNorm before each block, head tied to the embeddings: ``OPTConfig``'s defaults)."""
    return ShapeConfig(
        model_type="opt",
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        ffn_dim=ffn,
        word_embed_proj_dim=hidden,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        enable_bias=True,
        do_layer_norm_before=True,
        _remove_final_layer_norm=False,
        tie_word_embeddings=True,
    )


def gpt2_config(hidden: int, layers: int, heads: int, vocab: int, max_positions: int = 1024) -> ShapeConfig:
    """A GPT-2 decoder (MLP 4x wide, learnt positions, head tied to the embeddings: ``GPT2Config``'s defaults)."""
    return ShapeConfig(
        model_type="gpt2",
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        n_inner=None,
        n_positions=max_positions,
        vocab_size=vocab,
        tie_word_embeddings=True,
    )
