"""scikit-learn baselines on the same split: TF-IDF + logistic regression on buckets, TF-IDF + ridge on log length."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression, Ridge

from predictor.heuristic import prompt_length_heuristic

__all__ = ["prompt_length_heuristic", "tfidf_logreg", "tfidf_ridge"]


def _vectorizer() -> TfidfVectorizer:
    return TfidfVectorizer(ngram_range=(1, 2), min_df=2, max_features=200_000, sublinear_tf=True)


def tfidf_logreg(
    train_prompts: Sequence[str],
    train_labels: np.ndarray,
    test_prompts: Sequence[str],
    n_labels: int,
    c: float = 4.0,
) -> np.ndarray:
    """Bucket probabilities ``(len(test), n_labels)`` from TF-IDF + multinomial logistic regression."""
    vec = _vectorizer()
    x = vec.fit_transform(train_prompts)
    clf = LogisticRegression(C=c, max_iter=1000)
    clf.fit(x, train_labels)
    probs = np.zeros((len(test_prompts), n_labels))
    probs[:, clf.classes_] = clf.predict_proba(vec.transform(test_prompts))
    return probs


def tfidf_ridge(
    train_prompts: Sequence[str], train_lengths: np.ndarray, test_prompts: Sequence[str], alpha: float = 1.0
) -> np.ndarray:
    """Predicted tokens from TF-IDF + ridge regression on ``log(1 + length)``."""
    vec = _vectorizer()
    x = vec.fit_transform(train_prompts)
    reg = Ridge(alpha=alpha)
    reg.fit(x, np.log1p(np.asarray(train_lengths, dtype=np.float64)))
    return np.expm1(reg.predict(vec.transform(test_prompts))).clip(min=0)
