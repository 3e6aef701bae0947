"""Fine-tuning loop: AdamW with linear warm-up/decay, batch 32, validation-loss early stopping.

MICO's recipe (lr 5e-5, batch 32, 3 epochs) is the default for pretrained checkpoints;
models built from scratch need a larger learning rate (the CLI picks 5e-4 for them).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import get_linear_schedule_with_warmup

from predictor import checkpoint
from predictor.features import FeatureDistiller
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
    ordinal_sigma: float = 0.0  # >0: soft targets exp(-(k - y)^2 / (2 sigma^2)) over bucket indices k
    ema: float = 0.0  # >0: evaluate and keep an exponential moving average of the weights (decay per step)
    rank_weight: float = 0.0  # >0: weight of the pairwise ranking term on expected log tokens (rank_loss)
    teacher_weight: float = 0.5  # share of a teacher's bucket probabilities in the target, when one is given
    # >0: weight of the feature-distillation term (predictor.features), when teacher features are given
    feature_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.epochs <= 0 or self.batch_size < 1 or self.lr <= 0 or self.evals_per_epoch < 1:
            raise ValueError(f"training config out of range: {self}")
        if self.ordinal_sigma < 0 or not 0 <= self.ema < 1 or self.rank_weight < 0:
            raise ValueError(f"training config out of range: {self}")
        if not 0 <= self.teacher_weight <= 1 or self.feature_weight < 0:
            raise ValueError(f"training config out of range: {self}")


@dataclass
class TrainResult:
    history: list[dict] = field(default_factory=list)
    initial_val_loss: float = math.nan
    best_val_loss: float = math.nan
    best_step: int = 0
    steps: int = 0
    stopped_early: bool = False
    point_estimate: str = "expected"  # the model's declared point estimate (chosen on validation data)
    val_estimates: dict = field(default_factory=dict)  # validation figures of every point estimate


@torch.no_grad()
def val_loss(
    model,
    ids: list[list[int]],
    labels: np.ndarray,
    pad_id: int,
    batch_size: int = 128,
    probs_out: np.ndarray | None = None,
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy on pre-encoded examples (bucket probabilities into ``probs_out``)."""
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
        if probs_out is not None:
            probs_out[idx] = torch.softmax(logits.float(), -1).cpu().numpy()
    model.train(was)
    return total / max(len(ids), 1), correct / max(len(ids), 1)


def expectation_loss(logits: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Squared error between ``log(1 + E_p[tokens])`` and ``log(1 + length)``.

    Cross-entropy alone ignores that buckets are ordered; this term trains the very number the
    assigner uses (the probability-weighted expectation) to rank and scale well.
    """
    expected = torch.softmax(logits.float(), dim=-1) @ values
    return torch.mean((torch.log1p(expected) - torch.log1p(lengths.float())) ** 2)


def rank_loss(
    logits: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor, margin: float = 0.1
) -> torch.Tensor:
    """Pairwise logistic (RankNet) loss on the expected log tokens of every pair in the batch.

    Kendall tau counts ordered pairs; cross-entropy never compares two queries. For each pair whose
    true log lengths differ by more than ``margin``, ``softplus(-(s_i - s_j))`` with ``s`` the
    predictive mean of ``log(1 + tokens)`` and ``i`` the longer answer.
    """
    s = torch.softmax(logits.float(), dim=-1) @ torch.log1p(values)
    t = torch.log1p(lengths.float())
    diff_t = t[:, None] - t[None, :]
    pairs = diff_t > margin
    if not pairs.any():
        return s.sum() * 0.0
    diff_s = s[:, None] - s[None, :]
    return F.softplus(-diff_s[pairs]).mean()


def soft_targets(labels: torch.Tensor, n: int, sigma: float) -> torch.Tensor:
    """Ordinal soft labels: ``exp(-(k - y)^2 / (2 sigma^2))`` over bucket indices ``k``, normalised.

    Buckets are ordered; a near miss should cost less than a far one. With quantile buckets the
    index is the training-length quantile, so ``sigma`` is a width in quantile steps.
    """
    k = torch.arange(n, device=labels.device, dtype=torch.float32)
    w = torch.exp(-((k[None, :] - labels[:, None].float()) ** 2) / (2 * sigma**2))
    return w / w.sum(1, keepdim=True)


def _target_loss(
    logits: torch.Tensor, labels: torch.Tensor, cfg: TrainConfig, teacher: np.ndarray | None
) -> torch.Tensor:
    """Cross-entropy against the label target (hard, or ordinal-soft), mixed with a teacher's rows."""
    if cfg.ordinal_sigma <= 0 and teacher is None:
        return F.cross_entropy(logits, labels)
    if cfg.ordinal_sigma > 0:
        target = soft_targets(labels, logits.shape[-1], cfg.ordinal_sigma)
    else:
        target = F.one_hot(labels, logits.shape[-1]).float()
    if teacher is not None:
        w = cfg.teacher_weight
        target = (1 - w) * target + w * torch.as_tensor(teacher, device=logits.device)
    return -(target * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


class _Ema:
    """Exponential moving average of a model's floating-point weights."""

    def __init__(self, model, decay: float) -> None:
        self.decay = decay
        self.updates = 0
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}

    @torch.no_grad()
    def update(self, model) -> None:
        # the effective decay ramps up, min(decay, (1 + t) / (10 + t)), so early weights fade fast
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for k, v in model.state_dict().items():
            if k in self.shadow:
                self.shadow[k].mul_(d).add_(v.detach(), alpha=1 - d)

    def state_dict(self, model) -> dict:
        return {k: self.shadow.get(k, v) for k, v in model.state_dict().items()}


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
    evaluate=None,
    teacher_probs: np.ndarray | None = None,
    checkpoint_path: str | os.PathLike | None = None,
    teacher_features: np.ndarray | None = None,
) -> TrainResult:
    """Train ``model`` in place; on return it holds the weights of the best validation loss.

    With ``train_lengths`` and the buckets' representative ``values`` given, the loss adds
    ``cfg.log_weight`` times :func:`expectation_loss`; early stopping watches cross-entropy.
    ``evaluate(val_probs) -> dict``, if given, adds figures (e.g. Kendall tau) to each history entry.
    ``teacher_probs`` (one row of bucket probabilities per training prompt, e.g. an ensemble's mean)
    distils a teacher: the target becomes ``(1 - w) * label target + w * teacher row`` with
    ``w = cfg.teacher_weight``. ``teacher_features`` (one row per training prompt: the vector the
    teacher's head reads) adds ``cfg.feature_weight`` times the :class:`FeatureDistiller` term when
    that weight is positive. ``checkpoint_path``: the training state is saved there at every
    evaluation and resumed from it when it exists (:mod:`predictor.checkpoint`); it is removed once
    training finishes, and kept when the ``max_minutes`` cap stops it.
    """
    if not train_prompts or not val_prompts:
        raise ValueError("training needs non-empty train and validation sets")
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    tr_ids = encode(tokenizer, train_prompts, cfg.max_len, cfg.truncation)
    va_ids = encode(tokenizer, val_prompts, cfg.max_len, cfg.truncation)
    train_labels = np.asarray(train_labels, dtype=np.int64)
    use_exp = cfg.log_weight > 0 and train_lengths is not None and values is not None
    use_rank = cfg.rank_weight > 0 and train_lengths is not None and values is not None
    if use_exp or use_rank:
        tr_len = np.asarray(train_lengths, dtype=np.float32)
        vals = torch.as_tensor(np.asarray(values, dtype=np.float32), device=device)
    val_labels = np.asarray(val_labels, dtype=np.int64)
    if teacher_probs is not None:
        teacher_probs = np.asarray(teacher_probs, dtype=np.float32)
        n_classes = model.config.num_labels
        if teacher_probs.shape != (len(tr_ids), n_classes):
            raise ValueError(
                f"teacher probabilities have shape {teacher_probs.shape}; need one row of {n_classes} "
                "bucket probabilities per training prompt"
            )
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)

    steps_per_epoch = math.ceil(len(tr_ids) / cfg.batch_size)
    total_steps = max(1, math.ceil(cfg.epochs * steps_per_epoch))
    eval_every = max(1, steps_per_epoch // cfg.evals_per_epoch)
    distiller = (
        FeatureDistiller(model, teacher_features, len(tr_ids))
        if teacher_features is not None and cfg.feature_weight > 0
        else None
    )
    params = list(model.parameters()) + ([] if distiller is None else list(distiller.parameters()))
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = get_linear_schedule_with_warmup(opt, int(cfg.warmup * total_steps), total_steps)

    ema = _Ema(model, cfg.ema) if cfg.ema > 0 else None
    result = TrainResult()
    fp = checkpoint.fingerprint(
        tokenizer, len(tr_ids), model.config.num_labels, total_steps, model.config.to_dict(), asdict(cfg)
    )
    saved = checkpoint.load(checkpoint_path, fp)
    step, running, pos, bad = 0, [], 0, 0
    if saved is None:
        result.initial_val_loss, acc0 = val_loss(model, va_ids, val_labels, pad)
        result.best_val_loss = result.initial_val_loss
        best_state = copy.deepcopy(model.state_dict())
        log.info("initial validation loss %.4f, accuracy %.3f", result.initial_val_loss, acc0)
        order = rng.permutation(len(tr_ids))
    else:
        model.load_state_dict(saved["model"])
        if distiller is not None:
            distiller.load_state_dict(saved["features"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        if ema is not None:
            ema.shadow = {k: v.to(device) for k, v in saved["ema"].items()}
            ema.updates = saved["ema_updates"]
        best_state = saved["best"]
        for k, v in saved["result"].items():
            setattr(result, k, v)
        step, pos, bad, order = saved["step"], saved["pos"], saved["bad"], saved["order"]
        rng.bit_generator.state = saved["rng"]
        torch.set_rng_state(saved["torch_rng"])
    started = time.monotonic()
    timed_out = False
    model.train()
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", disable=not progress)
    try:
        while step < total_steps:
            if pos >= len(order):
                order, pos = rng.permutation(len(tr_ids)), 0
            idx = order[pos : pos + cfg.batch_size]
            pos += cfg.batch_size
            input_ids, mask = collate([tr_ids[i] for i in idx], pad)
            y = torch.as_tensor(train_labels[idx], device=device)
            logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
            loss = _target_loss(logits, y, cfg, None if teacher_probs is None else teacher_probs[idx])
            if use_exp:
                loss = loss + cfg.log_weight * expectation_loss(
                    logits, torch.as_tensor(tr_len[idx], device=device), vals
                )
            if use_rank:
                loss = loss + cfg.rank_weight * rank_loss(
                    logits, torch.as_tensor(tr_len[idx], device=device), vals
                )
            if distiller is not None:
                loss = loss + cfg.feature_weight * distiller.loss(idx)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update(model)
            step += 1
            running.append(loss.item())
            bar.update(1)
            out_of_time = cfg.max_minutes is not None and time.monotonic() - started > 60 * cfg.max_minutes
            # the cap stops the run at its next scheduled evaluation, never at one of its own: an evaluation the
            # uninterrupted run does not make, kept as the best weights, would set a resumed run apart
            if step % eval_every == 0 or step == total_steps:
                if ema is not None:  # evaluate (and keep) the averaged weights
                    live = copy.deepcopy(model.state_dict())
                    model.load_state_dict(ema.state_dict(model))
                vprobs = np.zeros((len(va_ids), logits.shape[-1])) if evaluate is not None else None
                vl, vacc = val_loss(model, va_ids, val_labels, pad, probs_out=vprobs)
                entry = {
                    "step": step,
                    "epoch": round(step / steps_per_epoch, 3),
                    "train_loss": float(np.mean(running)),
                    "val_loss": vl,
                    "val_accuracy": vacc,
                }
                if evaluate is not None:
                    entry.update(evaluate(vprobs))
                running = []
                result.history.append(entry)
                bar.set_postfix(val_loss=f"{vl:.3f}", val_acc=f"{vacc:.3f}")
                log.info(
                    "step %d epoch %.2f: train loss %.4f, val loss %.4f, val acc %.3f%s",
                    step,
                    entry["epoch"],
                    entry["train_loss"],
                    vl,
                    vacc,
                    "".join(
                        f", {k} {v:.4g}"
                        for k, v in entry.items()
                        if k.startswith("val_") and k not in ("val_loss", "val_accuracy")
                    ),
                )
                if vl < result.best_val_loss - 1e-4:
                    result.best_val_loss, result.best_step, bad = vl, step, 0
                    best_state = copy.deepcopy(model.state_dict())
                if ema is not None:
                    model.load_state_dict(live)
                improved = result.best_step == step
                if not improved:
                    bad += 1
                if checkpoint_path is not None:
                    checkpoint.save(
                        checkpoint_path,
                        {
                            "fingerprint": fp,
                            "step": step,
                            "pos": pos,
                            "bad": bad,
                            "order": order,
                            "rng": rng.bit_generator.state,
                            "torch_rng": torch.get_rng_state(),
                            "model": model.state_dict(),
                            "features": None if distiller is None else distiller.state_dict(),
                            "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(),
                            "ema": None if ema is None else ema.shadow,
                            "ema_updates": 0 if ema is None else ema.updates,
                            "best": best_state,
                            "result": {
                                k: getattr(result, k)
                                for k in ("history", "initial_val_loss", "best_val_loss", "best_step")
                            },
                        },
                    )
                if not improved and bad >= cfg.patience:
                    log.info("early stop at step %d: no validation improvement in %d evaluations", step, bad)
                    result.stopped_early = True
                    break
                if out_of_time and step < total_steps:  # a run that ends at the cap is finished
                    log.info("stopping at step %d: time cap of %.1f minutes reached", step, cfg.max_minutes)
                    result.stopped_early = timed_out = True
                    break
    finally:  # an error mid-training must not leave the distiller's hook on the model
        bar.close()
        if distiller is not None:
            distiller.close()
    if not timed_out:
        checkpoint.remove(checkpoint_path)
    result.steps = step
    model.load_state_dict(best_state)
    model.eval()
    return result
