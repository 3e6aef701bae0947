"""``fleetbatch quant train-tiny``: train a small Llama-architecture LM on the shared text (CPU, minutes).

Random weights make perplexity meaningless, so the quality checks of ``fleetbatch quant eval`` use a model
trained here: Llama (hidden 128, 4 layers, GQA 4/2 heads, tied embeddings; small so that a few
minutes on 2 shared cores teach it something) with the project's
default BPE tokenizer, on the ``train`` split of :mod:`quant.textdata`, AdamW with warmup and
cosine decay, stopped after ``max_steps`` or ``minutes``, whichever comes first. Saved with
``save_pretrained`` (model + tokenizer) so ``localmodels.load_model`` loads it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from localmodels import default_tokenizer
from quant.textdata import split_texts, token_blocks

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    out_dir: str = "runs/tiny-llama"
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 344
    seq_len: int = 128
    batch_size: int = 8
    lr: float = 3e-3
    warmup: int = 30
    max_steps: int = 400
    minutes: float = 5.0
    max_train_tokens: int = 1_000_000
    seed: int = 0
    threads: int = 2
    data_dir: str | None = None


def train_tiny(cfg: TrainConfig) -> dict:
    """Train and save; returns a summary (steps, tokens, final loss, seconds, path)."""
    if cfg.max_steps <= 0 or cfg.minutes <= 0:
        raise ValueError("max_steps and minutes must be positive")
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    tok = default_tokenizer()
    blocks = token_blocks(split_texts("train", cfg.data_dir), tok, cfg.seq_len, cfg.max_train_tokens)
    log.info("training on %d blocks of %d tokens", len(blocks), cfg.seq_len)
    mcfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=max(256, cfg.seq_len),
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(mcfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        # cosine decay over whichever budget (steps or wall clock) runs out first
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        by_steps = (step - cfg.warmup) / max(1, cfg.max_steps - cfg.warmup)
        by_time = (time.monotonic() - start) / (cfg.minutes * 60)
        frac = max(by_steps, by_time)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    gen = torch.Generator().manual_seed(cfg.seed)
    start = time.monotonic()
    deadline = start + cfg.minutes * 60
    losses: list[float] = []
    step = 0
    bar = tqdm(total=cfg.max_steps, desc="train-tiny", unit="step")
    while step < cfg.max_steps and time.monotonic() < deadline:
        idx = torch.randint(0, len(blocks), (cfg.batch_size,), generator=gen)
        x = blocks[idx]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    summary = {
        "out_dir": str(out),
        "steps": step,
        "tokens": step * cfg.batch_size * cfg.seq_len,
        "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "seconds": round(time.monotonic() - start, 1),
        "params": sum(p.numel() for p in model.parameters()),
        "config": asdict(cfg),
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1))
    log.info("saved the model after %d steps (loss %.3f) to %s", step, summary["final_loss"], out)
    return summary
