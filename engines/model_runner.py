"""Run a Hugging Face decoder over a mixed batch of prefill chunks and decode tokens with a paged KV cache.

The decoder's own modules (embeddings, norms, projections, MLPs, rotary embedding) do the
work; what ``transformers`` lacks for iteration-level batching is the attention over a paged
cache, written here: all tokens of a step are flattened into one ``[T, hidden]`` tensor, each
layer writes its new K/V into the layer's pool at the tokens' slots, then attends over K/V
gathered from the pool — decode tokens of all queries together in one padded call, each
prefill chunk in its own causal call. Architectures: Llama family, GPT-2, OPT.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.decode_attention import DECODE_CHUNK_BYTES, DecodePlan, plan_decode
from engines.kv_cache import KVCacheManager
from engines.scheduler import ScheduledChunk
from engines.step_batch import AttentionMeta, StepBatch
from quant.kv import dequantize_kv, quantize_kv


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def gather(pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``pool[idx]`` for a pool of slots ``[slots, ...]``: ``index_select`` copies each slot's row in one
    piece, where advanced indexing copies element by element (measured: 5x faster for decode's
    64 queries x 160 slots x 4 heads x 64 dims, which took over half of a decode step)."""
    return pool.index_select(0, idx.reshape(-1)).view(*idx.shape, *pool.shape[1:])


class DecoderAdapter:
    """The per-architecture parts of a forward pass, on flat ``[T, hidden]`` tensors."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    lm_head: torch.nn.Module

    def embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor: ...

    def prepare(self, h: torch.Tensor, pos: torch.Tensor) -> object:
        return None

    def qkv(
        self, i: int, h: torch.Tensor, aux: object
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def scale(self, i: int) -> float: ...

    def post(self, i: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor: ...

    def final(self, h: torch.Tensor) -> torch.Tensor:
        """The hidden states the LM head reads: after the final norm (and OPT's output projection)."""
        ...

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final(h))


class LlamaAdapter(DecoderAdapter):
    """Llama-style decoders (``model.model.layers``, rotary positions, GQA): Llama, Mistral, Qwen2."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.m, self.lm_head = model.model, model.lm_head
        cfg = model.config
        self.layers = self.m.layers
        self.num_layers = len(self.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        attn = next(layer.self_attn for layer in self.layers if hasattr(layer, "self_attn"))  # stage-safe
        self.head_dim = attn.head_dim
        self._scale = attn.scaling

    def embed(self, ids, pos):
        return self.m.embed_tokens(ids)

    def prepare(self, h, pos):
        cos, sin = self.m.rotary_emb(h[None], pos[None])
        return cos[0][:, None, :], sin[0][:, None, :]

    def qkv(self, i, h, aux):
        layer, t = self.layers[i], h.shape[0]
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = a.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = a.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        cos, sin = aux
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def scale(self, i):
        return self._scale

    def post(self, i, h, attn):
        layer = self.layers[i]
        h = h + layer.self_attn.o_proj(attn)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def final(self, h):
        return self.m.norm(h)


class GPT2Adapter(DecoderAdapter):
    def __init__(self, model: torch.nn.Module) -> None:
        self.t, self.lm_head = model.transformer, model.lm_head
        cfg = model.config
        self.layers = self.t.h
        self.num_layers = len(self.layers)
        self.num_heads = self.num_kv_heads = cfg.n_head
        self.hidden = cfg.n_embd
        self.head_dim = cfg.n_embd // cfg.n_head
        self._scales = []
        for i in range(self.num_layers):
            s = self.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
            if cfg.scale_attn_by_inverse_layer_idx:
                s /= float(i + 1)
            self._scales.append(s)

    def embed(self, ids, pos):
        return self.t.wte(ids) + self.t.wpe(pos)

    def qkv(self, i, h, aux):
        layer, t = self.layers[i], h.shape[0]
        q, k, v = layer.attn.c_attn(layer.ln_1(h)).split(self.hidden, dim=-1)
        shape = (t, self.num_heads, self.head_dim)
        return q.view(shape), k.view(shape), v.view(shape)

    def scale(self, i):
        return self._scales[i]

    def post(self, i, h, attn):
        layer = self.layers[i]
        h = h + layer.attn.c_proj(attn)
        return h + layer.mlp(layer.ln_2(h))

    def final(self, h):
        return self.t.ln_f(h)


class OPTAdapter(DecoderAdapter):
    def __init__(self, model: torch.nn.Module) -> None:
        self.d, self.lm_head = model.model.decoder, model.lm_head
        cfg = model.config
        self.layers = self.d.layers
        self.num_layers = len(self.layers)
        self.num_heads = self.num_kv_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.before = cfg.do_layer_norm_before

    def embed(self, ids, pos):
        x = self.d.embed_tokens(ids)
        if self.d.project_in is not None:
            x = self.d.project_in(x)
        pe = self.d.embed_positions
        return x + F.embedding(pos + pe.offset, pe.weight)

    def qkv(self, i, h, aux):
        layer, t = self.layers[i], h.shape[0]
        a = layer.self_attn
        x = layer.self_attn_layer_norm(h) if self.before else h
        shape = (t, self.num_heads, self.head_dim)
        return (a.q_proj(x) * a.scaling).view(shape), a.k_proj(x).view(shape), a.v_proj(x).view(shape)

    def scale(self, i):
        return 1.0  # OPT scales the queries before attention

    def post(self, i, h, attn):
        layer = self.layers[i]
        h = h + layer.self_attn.out_proj(attn)
        if not self.before:
            h = layer.self_attn_layer_norm(h)
        x = layer.final_layer_norm(h) if self.before else h
        h = h + layer.fc2(layer.activation_fn(layer.fc1(x)))
        if not self.before:
            h = layer.final_layer_norm(h)
        return h

    def final(self, h):
        if self.d.final_layer_norm is not None:
            h = self.d.final_layer_norm(h)
        if self.d.project_out is not None:
            h = self.d.project_out(h)
        return h


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` as a torch device; a CUDA device that is not there is an error.

    Asked for CUDA, the runner never falls back to the CPU silently: the error says why.
    """
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device {name!r} is not supported: the model runner runs on cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {name!r} asked for, but CUDA is not available here "
            "(torch.cuda.is_available() is False); use --device cpu"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"device {name!r} asked for, but only {count} CUDA device(s) are visible")
    return dev


def make_adapter(model: torch.nn.Module) -> DecoderAdapter:
    kind = model.config.model_type
    if kind == "gpt2":
        return GPT2Adapter(model)
    if kind == "opt":
        return OPTAdapter(model)
    if hasattr(model, "model") and hasattr(model.model, "rotary_emb") and hasattr(model.model, "layers"):
        return LlamaAdapter(model)
    raise ValueError(
        f"unsupported architecture {kind!r}: the native engine runs Llama-family, GPT-2 and OPT decoders"
    )


class ModelRunner:
    """Owns the model (or one stage's layers of it) and those layers' KV pools.

    ``run`` computes one step over all layers and returns logits to sample from; a pipeline
    stage calls ``embed`` (first stage), ``forward`` over its ``layers`` and ``logits`` (last
    stage) itself. Pools are keyed by global layer index, so a stage holds only its own.
    The model, the pools and each step's index tensors live on ``device`` (:func:`resolve_device`);
    the logits come back on it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        kv_bits: int = 16,
        layers: range | None = None,
        device: str = "cpu",
    ) -> None:
        self.device = resolve_device(device)
        self.model = model.to(self.device).eval()
        self.adapter = a = make_adapter(model)
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.kv_bits = kv_bits
        self.layers = layers if layers is not None else range(a.num_layers)
        #: K and V bytes gathered per decode attention call on the CPU (None: one call per step)
        self.decode_chunk_bytes: int | None = DECODE_CHUNK_BYTES
        shape = (num_blocks * block_size, a.num_kv_heads, a.head_dim)
        store = torch.int8 if kv_bits == 8 else self.dtype
        self.k_cache = {i: torch.zeros(shape, dtype=store, device=self.device) for i in self.layers}
        self.v_cache = {i: torch.zeros(shape, dtype=store, device=self.device) for i in self.layers}
        self.k_scale: dict[int, torch.Tensor] = {}
        self.v_scale: dict[int, torch.Tensor] = {}
        if kv_bits == 8:  # int8 codes with one fp16 scale per token and head (quant.kv)
            sshape = (shape[0], a.num_kv_heads, 1)
            ones = {"dtype": torch.float16, "device": self.device}
            self.k_scale = {i: torch.ones(sshape, **ones) for i in self.layers}
            self.v_scale = {i: torch.ones(sshape, **ones) for i in self.layers}

    def kv_pool_bytes(self) -> int:
        pools = [
            *self.k_cache.values(),
            *self.v_cache.values(),
            *self.k_scale.values(),
            *self.v_scale.values(),
        ]
        return sum(t.numel() * t.element_size() for t in pools)

    @staticmethod
    def kv_bytes_per_token(model: torch.nn.Module, kv_bits: int = 16) -> int:
        a = make_adapter(model)
        if kv_bits == 8:
            return 2 * a.num_layers * a.num_kv_heads * (a.head_dim + 2)
        elem = next(model.parameters()).element_size()
        return 2 * a.num_layers * a.num_kv_heads * a.head_dim * elem

    def _write(self, i: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.kv_bits == 8:
            for cache, scales, x in ((self.k_cache, self.k_scale, k), (self.v_cache, self.v_scale, v)):
                codes, scale = quantize_kv(x, 8, axis=-1)
                cache[i].index_copy_(0, slots, codes)
                scales[i].index_copy_(0, slots, scale.to(torch.float16))
            return
        self.k_cache[i].index_copy_(0, slots, k.to(self.dtype))
        self.v_cache[i].index_copy_(0, slots, v.to(self.dtype))

    def _read(self, i: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at cache slots ``idx`` (any shape): ``[*idx.shape, kv_heads, head_dim]``."""
        if self.kv_bits == 8:
            k = dequantize_kv(gather(self.k_cache[i], idx), gather(self.k_scale[i], idx), self.dtype)
            v = dequantize_kv(gather(self.v_cache[i], idx), gather(self.v_scale[i], idx), self.dtype)
            return k, v
        return gather(self.k_cache[i], idx), gather(self.v_cache[i], idx)

    def decode_plan(self, meta: AttentionMeta) -> DecodePlan | None:
        """How this step's decode attention runs (:mod:`engines.decode_attention`): on the CPU in
        chunks that keep the gathered K and V in cache, on a GPU in one call."""
        if meta.decode_slots is None:
            return None
        a = self.adapter
        per_slot = 2 * a.num_kv_heads * a.head_dim * self.dtype.itemsize  # K and V as attention reads them
        budget = self.decode_chunk_bytes if self.device.type == "cpu" else None
        rows = None if meta.all_decode else meta.decode_rows
        return plan_decode(rows, meta.decode_slots, meta.decode_mask, per_slot, budget)

    def _attend(self, i: int, q: torch.Tensor, meta: AttentionMeta, plan: DecodePlan | None) -> torch.Tensor:
        a = self.adapter
        t = q.shape[0]
        scale = a.scale(i)
        gqa = a.num_kv_heads != a.num_heads
        out = q.new_empty(t, a.num_heads, a.head_dim)
        if plan is not None:
            qd = q if plan.rows is None else q[plan.rows]
            parts = []
            for c in plan.chunks:
                k, v = self._read(i, c.slots)
                k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, KVH, L, D]
                o = F.scaled_dot_product_attention(
                    qd[c.lo : c.hi, :, None, :], k, v, attn_mask=c.mask, scale=scale, enable_gqa=gqa
                )
                parts.append(o)
            od = (parts[0] if len(parts) == 1 else torch.cat(parts))[:, :, 0, :]
            if plan.rows is None:
                out = od
            else:
                out.index_copy_(0, plan.rows, od)
        for row, n, slots, mask in meta.prefills:
            qp = q[row : row + n].transpose(0, 1)[None]  # [1, H, n, D]
            k, v = self._read(i, slots)
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qp, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
            )
            out[row : row + n] = o[0].transpose(0, 1)
        return out.reshape(t, a.num_heads * a.head_dim)

    # ---- one step: embed (first stage) -> this runner's layers -> logits (last stage) ----------------
    def embed(self, batch: StepBatch) -> torch.Tensor:
        return self.adapter.embed(torch.tensor(batch.token_ids, device=self.device), batch.positions)

    def forward(self, h: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Run this runner's layers over the flat hidden states ``h`` ``[T, hidden]``, filling their KV."""
        a = self.adapter
        aux = a.prepare(h, batch.positions)
        plan = self.decode_plan(batch.meta)
        for i in self.layers:
            q, k, v = a.qkv(i, h, aux)
            self._write(i, batch.slots, k, v)
            h = a.post(i, h, self._attend(i, q, batch.meta, plan))
        return h

    def logits(self, h: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Logits ``[n_sampled, vocab]`` of the rows after which a token is sampled."""
        if not batch.sample_rows:
            return h.new_empty(0, 0)
        return self.adapter.logits(h[torch.tensor(batch.sample_rows, device=h.device)])

    def final_hidden(self, h: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """What the LM head reads ``[n_sampled, hidden]`` for the sampled rows (a pipeline whose
        first stage computes part of the head gets these from the last)."""
        return self.adapter.final(h[torch.tensor(batch.sample_rows, device=h.device, dtype=torch.long)])

    @torch.inference_mode()
    def run_batch(self, batch: StepBatch) -> torch.Tensor:
        batch = batch.to(self.device)
        return self.logits(self.forward(self.embed(batch), batch), batch)

    def run(self, chunks: list[ScheduledChunk], kv: KVCacheManager) -> torch.Tensor:
        """Compute all scheduled tokens, fill their KV, return logits ``[n_sampling_chunks, vocab]``."""
        return self.run_batch(StepBatch.from_chunks(chunks, kv.block_size))
