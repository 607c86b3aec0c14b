"""Metrics: next-token agreement with the full cache, degeneration, and bytes held.

A new metric is one function here and one column where a command records it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..core.quant import dims


def token_stats(lp: mx.array, ref: mx.array, targets: mx.array) -> mx.array:
    """Sums over positions of KL(ref || lp), top-1 agreement, NLL of the targets under both,
    and the count; ``lp``/``ref`` are (n, V) log-probabilities."""
    kl = (mx.exp(ref) * (ref - lp)).sum(axis=-1)
    agree = (lp.argmax(axis=-1) == ref.argmax(axis=-1)).astype(mx.float32)
    nll = -mx.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    nll_full = -mx.take_along_axis(ref, targets[:, None], axis=-1)[:, 0]
    n = mx.array(float(lp.shape[0]))
    return mx.stack([kl.sum(), agree.sum(), nll.sum(), nll_full.sum(), n])


def repetition_rate(tokens: list[int], n: int = 10) -> float:
    """Fraction of n-grams that already occurred earlier in the sequence."""
    seen, repeated, total = set(), 0, 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        total += 1
        repeated += gram in seen
        seen.add(gram)
    return repeated / total if total else 0.0


def distinct(tokens: list[int], n: int) -> float:
    """Unique n-grams over all n-grams."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def held_bytes(cache) -> int:
    """Everything one cache holds: ``nbytes`` (for morphkv caches the K/V storage plus the
    selection state; for mlx_lm's caches their storage)."""
    return int(getattr(cache, "nbytes", 0) or 0)


def kv_bytes(caches) -> dict:
    """K/V storage, kept K+V bytes and everything held (storage + selection state), summed
    over layers."""
    storage = sum(int(getattr(c, "storage_nbytes", held_bytes(c))) for c in caches)
    kept = 0
    for c in caches:
        if hasattr(c, "morphkv_kept_bytes") and c.keys is not None:
            B, H, _ = dims(c.keys)  # plain arrays or quantized triplets
            kept += int(c.morphkv_kept_bytes) * B * H
        else:
            kept += int(getattr(c, "nbytes", 0))
    held = sum(held_bytes(c) for c in caches)
    return {"kv_bytes_storage": storage, "kv_bytes_kept": kept, "kv_bytes_held": held}


def cluster_interval(hits: list[list[bool]], draws: int = 2000, seed: int = 0):
    """(share, low, high): the share of items right, 95% bootstrap over chats."""
    hits = [h for h in hits if h]
    if not hits:
        return None
    rng = np.random.default_rng(seed)
    k = np.array([sum(h) for h in hits])
    n = np.array([len(h) for h in hits])
    idx = rng.integers(0, len(hits), (draws, len(hits)))
    shares = k[idx].sum(1) / n[idx].sum(1)
    return float(k.sum() / n.sum()), float(np.quantile(shares, 0.025)), float(
        np.quantile(shares, 0.975))
