"""Fine-tuning loop: AdamW with linear warm-up/decay, batch 32, validation-loss early stopping.

MICO's recipe (lr 5e-5, batch 32, 3 epochs) is the default for pretrained checkpoints;
models built from scratch need a larger learning rate (the CLI picks 5e-4 for them).
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from transformers import get_linear_schedule_with_warmup

from predictor.inference import collate, encode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    epochs: float = 3.0
    batch_size: int = 32
    lr: float = 5e-5
    weight_decay: float = 0.01
    warmup: float = 0.06  # fraction of steps
    evals_per_epoch: int = 2
    patience: int = 2  # evaluations without validation improvement before stopping
    max_len: int = 128
    truncation: str = "head_tail"  # how prompts longer than max_len are cut (see inference.encode)
    seed: int = 0
    max_minutes: float | None = None  # wall-clock cap; stops at the next evaluation after it
    log_weight: float = 1.0  # weight of the squared log error of the expected tokens (0: plain cross-entropy)

    def __post_init__(self) -> None:
        if self.epochs <= 0 or self.batch_size < 1 or self.lr <= 0 or self.evals_per_epoch < 1:
            raise ValueError(f"training config out of range: {self}")


@dataclass
class TrainResult:
    history: list[dict] = field(default_factory=list)
    initial_val_loss: float = math.nan
    best_val_loss: float = math.nan
    best_step: int = 0
    steps: int = 0
    stopped_early: bool = False


@torch.no_grad()
def val_loss(
    model, ids: list[list[int]], labels: np.ndarray, pad_id: int, batch_size: int = 128
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy on pre-encoded examples."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    total, correct = 0.0, 0
    order = np.argsort([len(x) for x in ids], kind="stable")
    for start in range(0, len(ids), batch_size):
        idx = order[start : start + batch_size]
        input_ids, mask = collate([ids[i] for i in idx], pad_id)
        y = torch.as_tensor(labels[idx], device=device)
        logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
        total += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
    model.train(was)
    return total / max(len(ids), 1), correct / max(len(ids), 1)


def expectation_loss(logits: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Squared error between ``log(1 + E_p[tokens])`` and ``log(1 + length)``.

    Cross-entropy alone ignores that buckets are ordered; this term trains the very number the
    assigner uses (the probability-weighted expectation) to rank and scale well.
    """
    expected = torch.softmax(logits.float(), dim=-1) @ values
    return torch.mean((torch.log1p(expected) - torch.log1p(lengths.float())) ** 2)


def train(
    model,
    tokenizer,
    train_prompts: list[str],
    train_labels: np.ndarray,
    val_prompts: list[str],
    val_labels: np.ndarray,
    cfg: TrainConfig,
    progress: bool = True,
    train_lengths: np.ndarray | None = None,
    values: np.ndarray | None = None,
) -> TrainResult:
    """Train ``model`` in place; on return it holds the weights of the best validation loss.

    With ``train_lengths`` and the buckets' representative ``values`` given, the loss adds
    ``cfg.log_weight`` times :func:`expectation_loss`; early stopping watches cross-entropy.
    """
    import time

    from tqdm import tqdm

    if not train_prompts or not val_prompts:
        raise ValueError("training needs non-empty train and validation sets")
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    tr_ids = encode(tokenizer, train_prompts, cfg.max_len, cfg.truncation)
    va_ids = encode(tokenizer, val_prompts, cfg.max_len, cfg.truncation)
    train_labels = np.asarray(train_labels, dtype=np.int64)
    use_exp = cfg.log_weight > 0 and train_lengths is not None and values is not None
    if use_exp:
        tr_len = np.asarray(train_lengths, dtype=np.float32)
        vals = torch.as_tensor(np.asarray(values, dtype=np.float32), device=device)
    val_labels = np.asarray(val_labels, dtype=np.int64)
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)

    steps_per_epoch = math.ceil(len(tr_ids) / cfg.batch_size)
    total_steps = max(1, math.ceil(cfg.epochs * steps_per_epoch))
    eval_every = max(1, steps_per_epoch // cfg.evals_per_epoch)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = get_linear_schedule_with_warmup(opt, int(cfg.warmup * total_steps), total_steps)

    result = TrainResult()
    result.initial_val_loss, acc0 = val_loss(model, va_ids, val_labels, pad)
    result.best_val_loss = result.initial_val_loss
    best_state = copy.deepcopy(model.state_dict())
    log.info("initial validation loss %.4f, accuracy %.3f", result.initial_val_loss, acc0)
    bad = 0
    started = time.monotonic()
    model.train()
    bar = tqdm(total=total_steps, desc="train", unit="step", disable=not progress)
    step, running = 0, []
    order = rng.permutation(len(tr_ids))
    pos = 0
    while step < total_steps:
        if pos >= len(order):
            order, pos = rng.permutation(len(tr_ids)), 0
        idx = order[pos : pos + cfg.batch_size]
        pos += cfg.batch_size
        input_ids, mask = collate([tr_ids[i] for i in idx], pad)
        y = torch.as_tensor(train_labels[idx], device=device)
        logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
        loss = F.cross_entropy(logits, y)
        if use_exp:
            loss = loss + cfg.log_weight * expectation_loss(
                logits, torch.as_tensor(tr_len[idx], device=device), vals
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        running.append(loss.item())
        bar.update(1)
        out_of_time = cfg.max_minutes is not None and time.monotonic() - started > 60 * cfg.max_minutes
        if step % eval_every == 0 or step == total_steps or out_of_time:
            vl, vacc = val_loss(model, va_ids, val_labels, pad)
            entry = {
                "step": step,
                "epoch": round(step / steps_per_epoch, 3),
                "train_loss": float(np.mean(running)),
                "val_loss": vl,
                "val_accuracy": vacc,
            }
            running = []
            result.history.append(entry)
            bar.set_postfix(val_loss=f"{vl:.3f}", val_acc=f"{vacc:.3f}")
            log.info(
                "step %d epoch %.2f: train loss %.4f, val loss %.4f, val acc %.3f",
                step,
                entry["epoch"],
                entry["train_loss"],
                vl,
                vacc,
            )
            if vl < result.best_val_loss - 1e-4:
                result.best_val_loss, result.best_step, bad = vl, step, 0
                best_state = copy.deepcopy(model.state_dict())
            else:
                bad += 1
                if bad >= cfg.patience:
                    log.info("early stop at step %d: no validation improvement in %d evaluations", step, bad)
                    result.stopped_early = True
                    break
            if out_of_time:
                log.info("stopping at step %d: time cap of %.1f minutes reached", step, cfg.max_minutes)
                result.stopped_early = True
                break
    bar.close()
    result.steps = step
    model.load_state_dict(best_state)
    model.eval()
    return result
