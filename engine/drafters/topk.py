"""The drafters' common last step: logits to the top-K draft distribution of each depth."""

from __future__ import annotations

import numpy as np


def topk_from_logits(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """logits [L, V] -> (top_logp float32 [L, K], top_ids int64 [L, K]) with K = min(k, V);
    log-prob = logit - logsumexp(row) in float64, rows sorted descending (ties: lower id first)."""
    logits = np.asarray(logits, dtype=np.float64)
    k = min(k, logits.shape[1])
    m = logits.max(axis=1, keepdims=True)
    logp = logits - (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))
    ids = np.argsort(-logp, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(logp, ids, axis=1).astype(np.float32), ids.astype(np.int64)
