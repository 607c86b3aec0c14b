"""Metrics: teacher-forced agreement with the full cache, degeneration, and bytes held.

Teacher-forced feeding (``evaluate``): the full-cache distributions are computed once (mlx_lm's
``KVCache``, chunked prefill); every config then feeds the same tokens in the attention hook's
exact chunks (each query reads what token-by-token decoding reads), the first ``budget`` tokens
(no eviction yet) in one chunk; the metrics cover the positions whose read set lacks an evicted
token. A new metric is one function here and one column where a command records it.
"""

from __future__ import annotations

import math
import time

import mlx.core as mx
import numpy as np

from ..core.quant import dims
from ..mlxlm.builder import KVCacheBuilder


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


def log_probs(logits: mx.array) -> mx.array:
    """Log-probabilities over the last axis, in float32."""
    z = logits.astype(mx.float32)
    return z - mx.logsumexp(z, axis=-1, keepdims=True)


def reference_logprobs(model, tokens: list[int], chunk: int = 256) -> mx.array:
    """Full-cache log-probabilities (T, V) float32 for every position: mlx_lm's ``KVCache``,
    chunked prefill (never ``model.make_cache``, which ``patch_model`` may have replaced)."""
    from mlx_lm.models.cache import KVCache

    cache = [KVCache() for _ in model.layers]
    out = []
    ids = mx.array([int(t) for t in tokens])
    for s in range(0, len(tokens), chunk):
        lp = log_probs(model(ids[None, s : s + chunk], cache=cache)[0])
        mx.eval(lp)
        out.append(lp)
    return mx.concatenate(out, axis=0)


def evaluate(model, tokens, ref_lp: mx.array, cfg, chunk: int = 256, bar=None) -> dict:
    """Teacher-forced metrics of one cache config on one token stream: the first ``budget``
    tokens in one piece (no eviction yet), then chunks of ``chunk`` through the attention hook
    (exact: every query reads what token-by-token decoding reads; ``tests/test_attach.py``)."""
    T_len = len(tokens)
    first = 0 if cfg.method == "full" else cfg.budget + 1  # the first read set missing a token
    ids = mx.array([int(t) for t in tokens])[None]
    targets = mx.array([int(t) for t in tokens[1:]] + [0])
    sums = np.zeros(5)  # KL, agreement, NLL, full NLL, count
    mx.reset_peak_memory()
    caches = KVCacheBuilder.for_model(model, cfg)  # attaches the hook
    t0, prefill = time.perf_counter(), max(0, min(first - 1, T_len))
    if prefill > 0:
        mx.eval(model(ids[:, :prefill], cache=caches))
    for s in range(prefill, T_len, chunk):
        lp = log_probs(model(ids[:, s : s + chunk], cache=caches))
        m = lp.shape[1]
        lo, hi = max(s, first), min(s + m, T_len - 1)  # the last position has no target
        if hi > lo:
            sums += np.array(token_stats(lp[0, lo - s : hi - s], ref_lp[lo:hi], targets[lo:hi]))
        if bar is not None:
            bar.update(m)
    elapsed, fed = time.perf_counter() - t0, T_len - prefill
    kl, ag, nm, nf, n = sums
    n = max(n, 1)
    return {"kl": kl / n, "top1": ag / n, "ppl_ratio": math.exp((nm - nf) / n), "nll": nm / n,
            "nll_full": nf / n, "positions": int(n), "peak_memory": int(mx.get_peak_memory()),
            "arms_in_pass": 1, "seconds": elapsed,
            "tokens_per_s": fed / elapsed if elapsed > 0 else float("nan"), **kv_bytes(caches)}


def position_kl(model, caches, tokens: list[int], ref: mx.array, first: int, prefill: int,
                chunk: int = 256) -> tuple[int, float]:
    """(positions, KL(full || caches) summed chunk by chunk, as the commands always summed it)
    over positions ``first``..end-2 (the last has no target), teacher-forced: ``prefill``
    tokens in one piece, then chunks of ``chunk``."""
    ids = mx.array([int(t) for t in tokens])[None]
    pos, n, total = 0, 0, 0.0
    while pos < len(tokens) - 1:
        step = prefill if pos == 0 and prefill > 0 else chunk
        logits = model(ids[:, pos : pos + step], cache=caches)[0].astype(mx.float32)
        lo, hi = max(pos, first), min(pos + step, len(tokens) - 1)
        if hi > lo:
            lp, r = log_probs(logits[lo - pos : hi - pos]), ref[lo:hi]
            total += float((mx.exp(r) * (r - lp)).sum())
            n += hi - lo
        pos += step
    return n, total
