"""Teacher-forced feeding: one text through the caches of several configs, per-position
metrics summed against the full cache.

The full-cache next-token distributions are computed once (mlx_lm's ``KVCache``, chunked
prefill). Every config then decodes the same tokens, one config at a time; ``Feeder`` feeds
them in chunks of ``chunk`` (``"chunked"``, ``auto``: the attention hook's exact chunked mode,
every query of a chunk reads exactly what token-by-token decoding would read) or one token per
forward (``"step"``: the plain reference).

The first ``budget`` tokens cause no eviction, so they are prefilled in one chunk either way.
Metrics (``metrics.token_stats``) cover the positions whose read set lacks an evicted token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..mlxlm.builder import KVCacheBuilder
from .metrics import kv_bytes, token_stats


def reference_logprobs(model, tokens: list[int], chunk: int = 256) -> mx.array:
    """Full-cache log-probabilities (T, V) float32 for every position: mlx_lm's ``KVCache``,
    chunked prefill (never ``model.make_cache``, which ``patch_model`` may have replaced)."""
    from mlx_lm.models.cache import KVCache

    cache = [KVCache() for _ in model.layers]
    out = []
    ids = mx.array([int(t) for t in tokens])
    for s in range(0, len(tokens), chunk):
        logits = model(ids[None, s : s + chunk], cache=cache)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(lp)
        out.append(lp)
    return mx.concatenate(out, axis=0)


@dataclass
class Feeder:
    """Feeds one token stream through the caches of several configs (see the module doc)."""

    mode: str = "auto"
    chunk: int = 256
    notes: list = field(default_factory=list)

    def resolve(self) -> str:
        return "chunked" if self.mode == "auto" else self.mode

    def run(self, model, caches, tokens: list[int], prefill: int):
        """Yield (s, logprobs (1, n, V)) blocks covering positions prefill..T-1 through
        ``caches``; the first ``prefill`` tokens go in one chunk."""
        ids = mx.array([int(t) for t in tokens])[None]
        if prefill > 0:
            mx.eval(model(ids[:, :prefill], cache=caches))
        step = self.chunk if self.resolve() == "chunked" else 1
        for s in range(prefill, len(tokens), step):
            logits = model(ids[:, s : s + step], cache=caches).astype(mx.float32)
            yield s, logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def first_scored(cfg) -> int:
    """First position whose read set lacks an evicted token (0 for the full cache)."""
    return 0 if cfg.method == "full" else cfg.budget + 1


def evaluate_arms(model, tokens, ref_lp: mx.array, cfgs: list, feeder: Feeder, bar=None):
    """Teacher-forced metrics of several cache configs on one token stream (list of dicts)."""
    return [_evaluate(model, tokens, ref_lp, cfg, feeder, bar) for cfg in cfgs]


def _evaluate(model, tokens, ref_lp, cfg, feeder, bar) -> dict:
    T_len, first = len(tokens), first_scored(cfg)
    targets = mx.array([int(t) for t in tokens[1:]] + [0])
    sums = np.zeros(5)  # metrics.TOKEN_STATS
    mx.reset_peak_memory()
    caches = KVCacheBuilder.for_model(model, cfg)  # attaches the hook
    t0, fed = time.perf_counter(), 0
    for s, lp in feeder.run(model, caches, tokens, max(0, min(first - 1, T_len))):
        m = lp.shape[1]
        fed += m
        lo, hi = max(s, first), min(s + m, T_len - 1)  # the last position has no target
        if hi > lo:
            sums += np.array(token_stats(lp[0, lo - s : hi - s], ref_lp[lo:hi], targets[lo:hi]))
        if bar is not None:
            bar.update(m)
    elapsed = time.perf_counter() - t0
    kl, ag, nm, nf, n = sums
    n = max(n, 1)
    return {"kl": kl / n, "top1": ag / n, "ppl_ratio": math.exp((nm - nf) / n), "nll": nm / n,
            "nll_full": nf / n, "positions": int(n), "peak_memory": int(mx.get_peak_memory()),
            "arms_in_pass": 1, "seconds": elapsed,
            "tokens_per_s": fed / elapsed if elapsed > 0 else float("nan"), **kv_bytes(caches)}


def position_kl(model, caches, tokens: list[int], ref: mx.array, first: int, prefill: int,
                chunk: int = 256) -> tuple[np.ndarray, np.ndarray, float]:
    """Per position ``first``..end-2 (the last has no target): KL(full || caches) and top-1
    agreement, teacher-forced: ``prefill`` tokens in one piece, then chunks of ``chunk``; and
    the KL summed chunk by chunk (as the commands always summed it)."""
    ids = mx.array([int(t) for t in tokens])[None]
    kl, agree, pos, total = [], [], 0, 0.0
    while pos < len(tokens) - 1:
        step = prefill if pos == 0 and prefill > 0 else chunk
        logits = model(ids[:, pos : pos + step], cache=caches)[0].astype(mx.float32)
        lo, hi = max(pos, first), min(pos + step, len(tokens) - 1)
        if hi > lo:
            lp = logits[lo - pos : hi - pos]
            lp, r = lp - mx.logsumexp(lp, axis=-1, keepdims=True), ref[lo:hi]
            each = mx.exp(r) * (r - lp)
            kl.append(np.array(each.sum(axis=-1)))
            agree.append(np.array(lp.argmax(-1) == r.argmax(-1)))
            total += float(each.sum())
        pos += step
    if not kl:
        return np.zeros(0), np.zeros(0), 0.0
    return np.concatenate(kl), np.concatenate(agree), total
