"""Memory cost model: bytes a pipeline stage needs for its layers, KV cache, embeddings and activations.

Weights come from ``quant.accounting`` (the exact bytes ``QuantLinear`` stores); the KV cache
holds the whole batch at ``prompt_len + output_tokens`` tokens at the KV bit width; the first
stage holds the token/position embeddings, the last stage the final norm and the LM head (a
copy of tied embeddings when it is not also the first stage); activations are the peak of one
prefill micro-batch (or one decode micro-batch when larger). Grouped-query attention and gated
MLPs are covered through the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from planner.catalog import GIB, DeviceType
from planner.modelshape import ModelShape
from quant import accounting

FP16 = 2
FP32 = 4


@lru_cache(maxsize=4096)
def _layer_bytes(shape: ModelShape, bits: int, group_size: int) -> int:
    return accounting.decoder_layer_weight_bytes(shape.config, bits, group_size)


def usable_bytes(dev: DeviceType) -> int:
    """What a stage may use on ``dev``: 92% of memory minus 0.5 GiB (CUDA context, fragmentation); half of a CPU's RAM;
    all of an emulated device's budget."""
    if dev.emulated:
        return dev.memory_bytes
    if dev.is_cpu:
        return dev.memory_bytes // 2
    return int(dev.memory_bytes * 0.92 - 0.5 * GIB)


@dataclass(frozen=True)
class MemoryModel:
    shape: ModelShape
    batch: int
    prompt_len: int
    output_tokens: int
    kv_bits: int = 16
    group_size: int = 128
    act_bytes: int = FP16

    def layer_weight_bytes(self, bits: int) -> int:
        return _layer_bytes(self.shape, bits, self.group_size)

    def layer_kv_bytes(self) -> int:
        tokens = self.batch * (self.prompt_len + self.output_tokens)
        return tokens * accounting.kv_bytes_per_token(self.shape.config, self.kv_bits)

    def embedding_bytes(self) -> int:
        """Input side of the model (first stage): token + position embeddings (and input projections)."""
        return accounting.non_layer_weight_bytes(self.shape.config) - self._head_side_bytes(tied_copy=False)

    def _head_side_bytes(self, tied_copy: bool) -> int:
        s = self.shape
        h, v = s.hidden, s.vocab
        cfg = s.config
        if s.family == "gpt2":
            norm = 2 * h * FP16
            tied = True
        elif s.family == "opt":
            norm = 2 * h * FP16
            if not getattr(cfg, "do_layer_norm_before", True) or getattr(
                cfg, "_remove_final_layer_norm", False
            ):
                norm = 0
            tied = bool(getattr(cfg, "tie_word_embeddings", True))
            proj = getattr(cfg, "word_embed_proj_dim", h) or h
            head = v * proj * FP16
            return norm + (head if (not tied or tied_copy) else 0)
        else:
            norm = h * FP16
            tied = bool(getattr(cfg, "tie_word_embeddings", False))
        head = v * h * FP16
        return norm + (head if (not tied or tied_copy) else 0)

    def head_bytes(self, also_first: bool) -> int:
        """Output side (last stage): final norm + LM head; a tied head is copied unless this stage is also the first."""
        return self._head_side_bytes(tied_copy=not also_first)

    def activation_bytes(self, v_prefill: int, v_decode: int, last: bool, prefill_chunks: int = 1) -> int:
        """Peak transient bytes of one decoder layer's forward for the larger of the two micro-batches.

        With chunked prefill (``prefill_chunks`` = kappa) a prefill call holds ``ceil(s / kappa)``
        query tokens attending to up to ``s`` cached tokens.
        """
        s = self.shape
        a = self.act_bytes
        h, hd = s.hidden, s.head_dim
        q = s.heads * hd
        kv = s.kv_heads * hd
        mlp_width = s.intermediate * (2 if s.gated_mlp else 1)

        def peak(v: int, q_len: int, ctx: int) -> int:
            resid = 2 * v * q_len * h * a
            attn = v * q_len * (q + 2 * kv) * a + v * s.heads * q_len * ctx * a
            mlp = v * q_len * mlp_width * a
            return resid + max(attn, mlp)

        ctx = self.prompt_len + self.output_tokens
        chunk = -(-self.prompt_len // max(1, prefill_chunks))
        p = max(peak(v_prefill, chunk, self.prompt_len), peak(v_decode, 1, ctx))
        if last:
            p += max(v_prefill, v_decode) * s.vocab * FP32
        return p
