"""Cut a decoder model down to one pipeline stage: its layers, plus embeddings or LM head where it needs them.

The cut is a shallow copy of the module tree along the paths that change (the decoder's layer
list, the embedding, the LM head); every kept module and parameter is the original object, so
cutting copies no weights. Layers outside the stage become ``nn.Identity`` placeholders so
that layer ``i`` keeps its index. Sent to a stage process, only the kept tensors travel.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

#: model_type -> (layer list, input embeddings, LM head + final norm)
_PATHS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "gpt2": ("transformer.h", ("transformer.wte", "transformer.wpe"), ("lm_head", "transformer.ln_f")),
    "opt": (
        "model.decoder.layers",
        ("model.decoder.embed_tokens", "model.decoder.embed_positions"),
        ("lm_head", "model.decoder.final_layer_norm"),
    ),
}
_LLAMA = ("model.layers", ("model.embed_tokens",), ("lm_head", "model.norm"))


def _paths(model: nn.Module) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    return _PATHS.get(model.config.model_type, _LLAMA)


def _replace(module: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose submodule at dotted ``path`` is ``new`` (the original is untouched)."""
    head, _, rest = path.partition(".")
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._modules[head] = _replace(module._modules[head], rest, new) if rest else new
    return clone


def head_rows(model: nn.Module, start: int, end: int) -> nn.Linear:
    """A linear layer computing rows ``[start, end)`` of ``model``'s LM head: views of its weights, no copy."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"the LM head is a {type(head).__name__}, not a linear layer: it cannot be split by rows"
        )
    if not 0 <= start < end <= head.out_features:
        raise ValueError(f"LM head rows [{start}, {end}) outside its {head.out_features} rows")
    part = nn.Linear(head.in_features, end - start, bias=head.bias is not None, device="meta")
    part.weight = nn.Parameter(head.weight.detach()[start:end], requires_grad=False)
    if head.bias is not None:
        part.bias = nn.Parameter(head.bias.detach()[start:end], requires_grad=False)
    return part


def cut_stage(
    model: nn.Module, layer_start: int, layer_end: int, first: bool, last: bool, head_start: int = 0
) -> nn.Module:
    """The part of ``model`` that a stage holding layers ``[layer_start, layer_end)`` needs; the last
    stage keeps the LM head's rows from ``head_start`` on (the first stage computes the others)."""
    layers_path, embed_paths, head_paths = _paths(model)
    layers = model.get_submodule(layers_path)
    if not 0 <= layer_start < layer_end <= len(layers):
        raise ValueError(
            f"stage layers [{layer_start}, {layer_end}) outside the model's {len(layers)} layers"
        )
    kept = nn.ModuleList(
        [layers[i] if layer_start <= i < layer_end else nn.Identity() for i in range(len(layers))]
    )
    out = _replace(model, layers_path, kept)
    drop = ([] if first else list(embed_paths)) + ([] if last else list(head_paths))
    for path in drop:
        try:
            out.get_submodule(path)
        except AttributeError:
            continue
        out = _replace(out, path, nn.Identity())
    if last and head_start > 0:
        end = vocab_size(model)
        out = _replace(
            out, head_paths[0], head_rows(model, head_start, end) if head_start < end else nn.Identity()
        )
    return out


def module_bytes(module: nn.Module) -> int:
    """Bytes of the distinct parameters and buffers of ``module`` (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        key = t.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def hidden_size(model: nn.Module) -> int:
    cfg = model.config
    return int(getattr(cfg, "hidden_size", None) or cfg.n_embd)


def vocab_size(model: nn.Module) -> int:
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear):
        return int(head.out_features)
    return int(model.config.vocab_size)


def model_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype
