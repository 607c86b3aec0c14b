"""Teacher-forced feeding: one text through the caches of a config, per-position metrics
summed against the full cache.

The full-cache distributions are computed once (mlx_lm's ``KVCache``, chunked prefill); every
config then feeds the same tokens in the attention hook's exact chunks (each query reads what
token-by-token decoding reads), the first ``budget`` tokens (no eviction yet) in one chunk.
Metrics (``metrics.token_stats``) cover the positions whose read set lacks an evicted token.
"""

from __future__ import annotations

import math
import time

import mlx.core as mx
import numpy as np

from ..mlxlm.builder import KVCacheBuilder
from .metrics import kv_bytes, token_stats


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
