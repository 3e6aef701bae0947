"""The local models' architectures and sizes, as numbers: read by the planner and the simulator, which plan for
these models without building one (``localmodels.build`` imports torch and transformers)."""

from __future__ import annotations

ARCHS = ("llama", "gpt2", "opt")
#: name -> (hidden, layers, heads, kv_heads, intermediate)
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "nano": (64, 2, 4, 2, 172),
    "micro": (64, 8, 4, 2, 172),  # nano's width, eight layers: a planned fleet's default (room to split)
    "tiny": (256, 4, 8, 4, 688),
    "small": (512, 8, 8, 4, 1376),
    "base": (768, 12, 12, 4, 2048),
}
