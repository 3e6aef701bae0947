"""Batched forward passes: tokenise, pad per batch, return bucket probabilities."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tqdm import tqdm

from predictor.encoding import TRUNCATIONS, encode  # noqa: F401  (known from here too)


def collate(ids: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad a list of id lists into ``(input_ids, attention_mask)``."""
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, : len(x)] = torch.as_tensor(x, dtype=torch.long)
        mask[i, : len(x)] = 1
    return input_ids, mask


class HeadInput:
    """Keeps the last vector a bucket classifier's head read: the input of its ``classifier`` layer
    (DistilBERT's pooled ``[CLS]`` after ``pre_classifier``, or :class:`MeanPoolClassifier`'s mean)."""

    def __init__(self, model) -> None:
        self.value: torch.Tensor | None = None
        self._handle = model.classifier.register_forward_pre_hook(self._keep)

    def _keep(self, module, args) -> None:
        self.value = args[0]

    def close(self) -> None:
        self._handle.remove()


def predict_proba(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_len: int,
    batch_size: int = 64,
    progress: bool = False,
    truncation: str = "head_tail",
) -> np.ndarray:
    """Bucket probabilities ``(len(prompts), n_buckets)``; prompts are length-sorted into batches to cut padding."""
    probs, _ = predict_with_features(
        model, tokenizer, prompts, max_len, batch_size, progress, truncation, features=False
    )
    return probs


@torch.inference_mode()
def predict_with_features(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_len: int,
    batch_size: int = 64,
    progress: bool = False,
    truncation: str = "head_tail",
    features: bool = True,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Bucket probabilities and, with ``features``, the vector the head read for each prompt
    (:class:`HeadInput`, ``(len(prompts), head width)`` float32; what ``--feature-weight`` distils)."""
    out = np.zeros((len(prompts), model.config.num_labels), dtype=np.float64)
    feats = np.zeros((len(prompts), model.classifier.in_features), dtype=np.float32) if features else None
    if not prompts:
        return out, feats
    ids = encode(tokenizer, prompts, max_len, truncation)
    order = np.argsort([len(x) for x in ids], kind="stable")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    head = HeadInput(model) if features else None
    starts = range(0, len(ids), batch_size)
    if progress:
        starts = tqdm(starts, desc="predict", unit="batch")
    try:
        for start in starts:
            idx = order[start : start + batch_size]
            input_ids, mask = collate([ids[i] for i in idx], tokenizer.pad_token_id)
            logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
            out[idx] = torch.softmax(logits.float(), dim=-1).cpu().numpy()
            if head is not None:
                feats[idx] = head.value.float().cpu().numpy()
    finally:
        if head is not None:
            head.close()
        model.train(was_training)
    return out, feats
