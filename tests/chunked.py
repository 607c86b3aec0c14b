"""A stream fed to one cache in chunks, and what the NumPy reference keeps of it: the two halves
of every "same decisions for any chunking" test over the rule knobs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st
from reference import reference_kept

from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.core.rules import METHODS


def draw_config(draw, methods, blocks, slack: int, engine: str) -> KVCacheConfig:
    """A random config of one of ``methods`` for the property tests: every knob the rule takes
    (asked of the rule, so a new rule is drawn with its own), budgets a few tokens above what
    the sinks, the recent region and one block need."""
    method = draw(st.sampled_from(methods))
    rule = METHODS[method]
    window = draw(st.integers(1, 5))
    recent = draw(st.integers(window, window + 5))
    n_sink = draw(st.integers(0, 3))
    block = draw(st.sampled_from(blocks))
    budget = draw(st.integers(n_sink + recent + block, n_sink + recent + block + slack))
    peak = draw(st.sampled_from([0.0, 0.02, 0.5])) if "peak" in rule.knobs() else 0.0
    decays = "decay" in rule.knobs() and (peak > 0 or "peak" not in rule.knobs())
    return KVCacheConfig(
        method=method, morphkv_budget=budget, morphkv_n_sink=n_sink, morphkv_window=window,
        morphkv_recent=recent, morphkv_block=block,
        morphkv_fusion=draw(st.sampled_from(["mean", "max"])),
        morphkv_value=rule.attention and draw(st.booleans()), morphkv_peak=peak,
        morphkv_decay=draw(st.sampled_from([1.0, 0.9])) if decays else 1.0,
        morphkv_pool=draw(st.sampled_from([1, 3])) if rule.attention else 1,
        scoring=draw(st.sampled_from(["attention", "proxy"])), engine=engine,
    )


def feed_in_chunks(config, keys, queries, cuts):
    """A cache of ``config`` fed ``keys`` (1, H, T, D) cut at ``cuts``; with attention scoring
    each chunk's real queries (1, H, 2, T, D), 2 per KV head, are handed in by hand."""
    B, H, T, D = keys.shape
    cache = KVCacheBuilder.build(config)
    start = 0
    for end in [*cuts, T]:
        if end <= start:
            continue
        k = mx.array(keys[:, :, start:end])
        cache.update_and_fetch(k, k + 1)
        if config.scoring == "attention":
            q = queries[:, :, :, start:end].reshape(B, H * 2, end - start, D)
            cache.prepare_attention(mx.array(q), D**-0.5, None)
        start = end
    return cache


def reference_for(config, keys, queries, h):
    """The reference's kept positions of KV head ``h`` (values are keys + 1, as fed above)."""
    real = config.scoring == "attention"
    return reference_kept(
        keys[0, h], config.method, config.budget, config.morphkv_n_sink, config.window,
        config.morphkv_fusion, queries=queries[0, h].transpose(1, 0, 2) if real else None,
        recent=config.recent, values=keys[0, h] + 1 if config.morphkv_value else None,
        peak=config.morphkv_peak, decay=config.morphkv_decay, pool=config.morphkv_pool,
        block=config.block,
    )


def draw_geometry(draw, st, recent_span: int, blocks=(1, 1, 2, 3, 5)) -> dict:
    """Window, recent floor, sinks, block and a budget just large enough for them (hypothesis
    ``draw`` and ``strategies``), as KVCacheConfig fields."""
    window = draw(st.integers(1, 4))
    recent = draw(st.integers(window, window + recent_span))
    n_sink = draw(st.integers(0, 2))
    block = draw(st.sampled_from(list(blocks)))
    budget = draw(st.integers(n_sink + recent + block, n_sink + recent + block + 7))
    return dict(morphkv_budget=budget, morphkv_n_sink=n_sink, morphkv_window=window,
                morphkv_recent=recent, morphkv_block=block)


def draw_stream(draw, st, budget: int):
    """A stream of 2 KV heads x 8 dims for ``feed_in_chunks``: keys (1, 2, T, 8), queries (1, 2,
    2, T, 8) and up to 3 chunk cuts, T from the budget to about 3 budgets."""
    T = draw(st.integers(budget, 3 * budget + 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    keys = rng.standard_normal((1, 2, T, 8)).astype(np.float32)
    queries = rng.standard_normal((1, 2, 2, T, 8)).astype(np.float32)  # 2 query heads per KV
    cuts = sorted(draw(st.lists(st.integers(1, T - 1), max_size=3)))
    return keys, queries, cuts
