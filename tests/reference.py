"""Obviously-correct NumPy references of the eviction rules, one sequence and one head at a time.

Written straight from the README's rules, without the engine's ring buffers or slot reuse, so
the fast path can be held to it.
"""

from __future__ import annotations

import numpy as np

TIE_RTOL = 1e-9


def _softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.nan_to_num(logits, nan=-np.inf, posinf=np.finfo(np.float64).max)
    peak = logits.max(axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    e = np.exp(logits - peak)
    total = e.sum(axis=-1, keepdims=True)
    return e / np.where(total > 0, total, 1.0)


def reference_kept(
    keys: np.ndarray,
    method: str,
    budget: int,
    n_sink: int,
    window: int,
    fusion: str = "mean",
    queries: np.ndarray | None = None,
) -> list[int]:
    """Positions kept after feeding ``keys`` (T, D) one token at a time.

    ``queries`` (T, G, D) are real queries (G per KV head) for attention scoring; by default
    the keys stand in for them (G = 1).
    """
    keys = np.asarray(keys, np.float64)
    T, D = keys.shape
    queries = keys[:, None, :] if queries is None else np.asarray(queries, np.float64)
    scale = 1.0 / np.sqrt(D)
    if method == "sliding_window":
        n_sink = 0
    stored: list[int] = []
    h2o: dict[int, float] = {}
    for t in range(T):
        stored.append(t)
        K = keys[stored]
        if method == "h2o":
            h2o[t] = 0.0
            probs = _softmax(queries[t] @ K.T * scale).sum(axis=0)
            for p, s in zip(stored, probs, strict=True):
                h2o[p] += s
        if method == "full" or len(stored) <= budget:
            continue
        if method in ("sliding_window", "streaming_llm"):
            scores = np.array(stored, np.float64)
        elif method == "h2o":
            scores = np.array([h2o[p] for p in stored])
        elif method in ("tova", "morphkv"):
            rows = [t] if method == "tova" else stored[-window:]
            probs = _softmax(queries[rows] @ K.T * scale)  # (rows, G, stored)
            probs = probs.sum(axis=1)  # GQA: sum over the query heads of the group
            scores = probs.max(axis=0) if fusion == "max" else probs.mean(axis=0)
        else:
            raise ValueError(method)
        candidates = [
            (s, p) for s, p in zip(scores, stored, strict=True) if p >= n_sink and p <= t - window
        ]
        low = min(s for s, _ in candidates)
        victim = min(p for s, p in candidates if s <= low + TIE_RTOL * abs(low))
        stored.remove(victim)
        h2o.pop(victim, None)
    return stored
