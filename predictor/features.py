"""Feature distillation: the student's head input learns to predict the teacher's (``--feature-weight``).

A teacher's bucket probabilities carry about 20 numbers per prompt; the vector its bucket head reads
(the MiniLM teacher's mean-pooled 384-wide encoding) carries far more of what it learnt. Following
TinyBERT and DistilBERT, which match hidden states as well as outputs, the student's head input goes
through a learnt linear map (used in training only, not saved with the model) and is scored by the
mean squared error against the teacher's vector, standardised per dimension over the training
prompts. Student and teacher may have different tokenizers and widths: only the pooled vectors meet.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from predictor.inference import HeadInput


def standardise(features: np.ndarray) -> np.ndarray:
    """Each column to mean 0 and standard deviation 1 (constant columns to 0)."""
    f = np.asarray(features, dtype=np.float32)
    std = f.std(axis=0)
    return (f - f.mean(axis=0)) / np.where(std > 1e-6, std, 1.0)


class FeatureDistiller(torch.nn.Module):
    """The auxiliary term: ``mse(proj(student head input), standardised teacher features[idx])``.

    Build it around the student before the training step's forward pass; :meth:`loss` reads the
    head input that pass left behind. :meth:`close` removes the hook from the student.
    """

    def __init__(self, student: torch.nn.Module, teacher_features: np.ndarray, n_examples: int) -> None:
        super().__init__()
        f = np.asarray(teacher_features)
        if f.ndim != 2 or f.shape[0] != n_examples:
            raise ValueError(
                f"teacher features have shape {f.shape}; need one row per training prompt ({n_examples})"
            )
        self.targets = torch.as_tensor(standardise(f))  # a plain tensor: not part of the state dict
        self.proj = torch.nn.Linear(student.classifier.in_features, f.shape[1])
        self.proj.to(next(student.parameters()).device)
        self._head = HeadInput(student)

    def loss(self, idx: np.ndarray) -> torch.Tensor:
        h = self._head.value
        if h is None:
            raise RuntimeError("no forward pass of the student since the distiller was built")
        return F.mse_loss(self.proj(h), self.targets[torch.as_tensor(idx)].to(h.device))

    def close(self) -> None:
        self._head.close()
