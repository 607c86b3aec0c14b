"""A stream fed to one cache in chunks, and what the NumPy reference keeps of it: the two halves
of every "same decisions for any chunking" test over the rule knobs."""

from __future__ import annotations

import mlx.core as mx
from reference import reference_kept

from morphkv import KVCacheBuilder


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
