"""Asking a prefilled cache: how every recall evaluation reads a chat.

A chat is prefilled ONCE per arm (exact chunks: ``KVCacheBuilder.for_model`` attaches the
attention hook), up to what all its questions share; each question is then answered greedily
from a copy of the cache (``copy.deepcopy``). *Retention*: per layer, the fraction of the
asked value's own tokens still stored when the question arrives (mean over KV heads; morphkv's
caches and mlx_lm's alike).
"""

from __future__ import annotations

import copy

import numpy as np

from ..mlxlm.turns import common_prefix
from .models import greedy_tokens


def stored_positions(cache) -> np.ndarray:
    """(KV heads, n) absolute positions a layer's cache holds (morphkv or mlx_lm's caches)."""
    if hasattr(cache, "kept_positions"):
        return cache.kept_positions[0]
    offset = int(cache.offset)
    if hasattr(cache, "max_size") and offset > cache.max_size:  # RotatingKVCache
        keep = cache.keep
        kept = np.r_[np.arange(keep), np.arange(offset - cache.max_size + keep, offset)]
    else:
        kept = np.arange(offset)
    return kept[None, :]


def retention(caches, positions: tuple[int, ...]) -> list[float] | None:
    """Per layer: the fraction of ``positions`` stored, mean over KV heads."""
    if not positions:
        return None
    want = np.asarray(positions)
    return [float(np.isin(want, p).mean(axis=-1) if p.ndim == 1 else
                  np.mean([np.isin(want, row).mean() for row in p]))
            for p in map(stored_positions, caches)]


def prefill(model, caches, ids: list[int], chunk: int) -> None:
    import mlx.core as mx

    x = mx.array(ids)[None]
    for s in range(0, len(ids), chunk):
        mx.eval(model(x[:, s : s + chunk], cache=caches))


def ask(model, caches, prompts: list[list[int]], chunk: int, max_tokens: int = 0,
        positions=None) -> dict:
    """Prefill what the prompts share (all but the last token of a lone prompt), then per
    prompt: the retention of its ``positions`` (when given) and, with ``max_tokens``, the
    greedy answer's token ids from a copy of the caches. Bytes and tokens held."""
    n = (len(prompts[0]) - 1 if len(prompts) == 1 else
         min(common_prefix(prompts[0], p) for p in prompts[1:]))
    prefill(model, caches, prompts[0][:n], chunk)
    budgets = [c.config.budget for c in caches if hasattr(c, "config")]
    out = {"nbytes": int(sum(c.nbytes for c in caches)), "prefix": n,
           "tokens": max(budgets) if budgets else None}
    if positions is not None:
        out["retention"] = [retention(caches, p) for p in positions]
    if max_tokens:
        out["answers"] = [greedy_tokens(model, copy.deepcopy(caches), p[n:], max_tokens)
                          for p in prompts]
    return out


def until_end(tok, ids: list[int]) -> str:
    """The answer's text up to its first end token, stripped."""
    eos = set(getattr(tok, "eos_token_ids", None) or [tok.eos_token_id])
    return tok.decode(ids[: next((i for i, t in enumerate(ids) if t in eos), len(ids))]).strip()
