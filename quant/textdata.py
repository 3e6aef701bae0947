"""Real text from ``../shared/data`` for training, calibration and held-out perplexity.

The mixed workload (prompt and response of each record) is split deterministically by record
index: index % 20 == 0 -> ``heldout`` (perplexity), == 1 -> ``calib`` (indicator activations),
the rest -> ``train`` (``fleetbatch quant train-tiny``). So perplexity is measured on texts the model and the
indicator never saw.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fleetdata.datasets import load_mixed

SPLITS = ("train", "calib", "heldout")


def split_texts(split: str, root: str | Path | None = None) -> list[str]:
    """Texts of one split of the mixed workload (``prompt\\n\\nresponse``)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")

    records = load_mixed(Path(root) if root else None)
    want = {"heldout": (0,), "calib": (1,)}.get(split)
    out = []
    for i, r in enumerate(records):
        k = i % 20
        if (want is None and k > 1) or (want is not None and k in want):
            text = f"{r.prompt}\n\n{r.response}".strip()
            if text:
                out.append(text)
    return out


def token_blocks(texts: list[str], tokenizer, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """Concatenate tokenized texts (each followed by EOS) and cut into ``(n, seq_len)`` blocks."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, not {seq_len}")
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for start in range(0, len(texts), 512):
        enc = tokenizer(texts[start : start + 512], add_special_tokens=False)["input_ids"]
        for e in enc:
            ids.extend(e)
            if eos is not None:
                ids.append(eos)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    if max_tokens is not None:
        ids = ids[:max_tokens]
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"only {len(ids)} tokens of text; need at least {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).reshape(n, seq_len)
