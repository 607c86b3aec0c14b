"""The runner: feed one text through the caches of several configs, teacher-forced, and sum
per-position metrics against the full cache.

The full-cache next-token distributions are computed once (mlx_lm's ``KVCache``, chunked
prefill). Every config then decodes the same tokens; how they are fed is ``Feeder``:

- ``"chunked"`` (``auto``): chunks of ``chunk`` tokens, one
  config at a time, through the attention hook's exact chunked mode (every query of a chunk
  reads exactly what token-by-token decoding would read);
- ``"stacked"``: one token per forward, all proxy configs stacked on the
  batch axis (``StackedCache``); real-query configs go one at a time;
- ``"step"``: one token per forward, one config at a time (the plain reference).

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
from .process import peak_memory, reset_peak_memory


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


class StackedCache:
    """Single-sequence caches (one per config, possibly different budgets) stacked on the
    batch axis, so one forward decodes the same token for every config. Row i is exactly its
    own cache; shorter rows are zero-padded at the end and masked out. Every layer of a config
    keeps the same number of tokens, so the mask mlx_lm builds from layer 0 fits every layer."""

    def __init__(self, caches: list) -> None:
        self.caches = caches

    @property
    def offset(self) -> int:
        return self.caches[0].offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        outs = [c.update_and_fetch(keys[i : i + 1], values[i : i + 1])
                for i, c in enumerate(self.caches)]
        L = max(k.shape[2] for k, _ in outs)

        def pad(x):
            extra = L - x.shape[2]
            if extra == 0:
                return x
            return mx.concatenate([x, mx.zeros((*x.shape[:2], extra, x.shape[3]), x.dtype)], 2)

        return mx.concatenate([pad(k) for k, _ in outs]), mx.concatenate([pad(v) for _, v in outs])

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        lens = np.array([_kept(c) + N for c in self.caches])
        L = int(lens.max())
        if N == 1 and (lens == L).all():
            return None
        j = np.arange(L)[None, None, :]
        q = np.arange(N)[None, :, None]
        allowed = j <= (lens[:, None, None] - N + q)
        return mx.array(allowed[:, None])  # (B, 1, N, L)

    @property
    def state(self):
        return []


def _kept(cache) -> int:
    return int(cache.tokens_kept) if hasattr(cache, "tokens_kept") else int(cache.offset)


@dataclass
class Feeder:
    """Feeds one token stream through the caches of several configs (see the module doc)."""

    mode: str = "auto"
    chunk: int = 256
    notes: list = field(default_factory=list)

    def resolve(self) -> str:
        if self.mode == "auto":
            return "chunked"
        return self.mode

    def groups(self, cfgs: list) -> list[list[int]]:
        """Indices of the configs fed together."""
        if self.resolve() != "stacked":
            return [[i] for i in range(len(cfgs))]
        together = [i for i, c in enumerate(cfgs) if c.scoring == "proxy" or c.method == "full"]
        alone = [[i] for i in range(len(cfgs)) if i not in together]
        return ([together] if together else []) + alone

    def run(self, model, cfgs: list, tokens: list[int], prefill: int):
        """Yield (s, logprobs (len(cfgs), n, V), per-config caches) blocks covering positions
        prefill..T-1; the first ``prefill`` tokens go in one chunk."""
        mode = self.resolve()
        if mode == "stacked" and len(cfgs) == 1:
            mode = "step"
        per_arm = [KVCacheBuilder.for_model(model, c) for c in cfgs]  # attaches the hook
        if len(cfgs) > 1:
            caches = [StackedCache([arm[i] for arm in per_arm]) for i in range(len(per_arm[0]))]
        else:
            caches = per_arm[0]
        ids = mx.array([int(t) for t in tokens])[None]
        ids = mx.repeat(ids, len(cfgs), axis=0) if len(cfgs) > 1 else ids
        if prefill > 0:
            mx.eval(model(ids[:, :prefill], cache=caches))
        step = self.chunk if mode == "chunked" else 1
        for s in range(prefill, len(tokens), step):
            logits = model(ids[:, s : s + step], cache=caches).astype(mx.float32)
            yield s, logits - mx.logsumexp(logits, axis=-1, keepdims=True), per_arm


def first_scored(cfg) -> int:
    """First position whose read set lacks an evicted token (0 for the full cache)."""
    return 0 if cfg.method == "full" else cfg.budget + 1


def evaluate_arms(model, tokens, ref_lp: mx.array, cfgs: list, feeder: Feeder, bar=None):
    """Teacher-forced metrics of several cache configs on one token stream (list of dicts)."""
    results = [None] * len(cfgs)
    for group in feeder.groups(cfgs):
        sub = [cfgs[i] for i in group]
        found = _evaluate_group(model, tokens, ref_lp, sub, feeder, bar)
        for i, res in zip(group, found, strict=True):
            results[i] = res
    return results


def _evaluate_group(model, tokens, ref_lp, cfgs, feeder, bar):
    T_len = len(tokens)
    firsts = [first_scored(c) for c in cfgs]
    prefill = max(0, min(min(firsts) - 1, T_len))
    targets = mx.array([int(t) for t in tokens[1:]] + [0])
    sums = np.zeros((len(cfgs), 5))  # metrics.TOKEN_STATS
    reset_peak_memory()
    t0 = time.perf_counter()
    fed = 0
    per_arm = None
    for s, lp, arm_caches in feeder.run(model, cfgs, tokens, prefill):
        per_arm = arm_caches
        m = lp.shape[1]
        fed += m
        hi = min(s + m, T_len - 1)  # the last position has no target
        stats = []
        for b, first in enumerate(firsts):
            lo = max(s, first)
            if hi <= lo:
                stats.append(mx.zeros((5,)))
                continue
            stats.append(token_stats(lp[b, lo - s : hi - s], ref_lp[lo:hi], targets[lo:hi]))
        sums += np.array(mx.stack(stats))
        if bar is not None:
            bar.update(m * len(cfgs))
    elapsed = time.perf_counter() - t0
    peak = peak_memory()
    out = []
    for b in range(len(cfgs)):
        kl, ag, nm, nf, n = sums[b]
        n = max(n, 1)
        res = {"kl": kl / n, "top1": ag / n, "ppl_ratio": math.exp((nm - nf) / n), "nll": nm / n,
               "nll_full": nf / n, "positions": int(n), "peak_memory": peak,
               "arms_in_pass": len(cfgs), "seconds": elapsed,
               "tokens_per_s": fed / elapsed if elapsed > 0 else float("nan")}
        res.update(kv_bytes(per_arm[b] if per_arm else []))
        out.append(res)
    return out


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
