"""Topic shift: early keys on axis A, late weaker noisy keys on axis B read by the window.

MorphKV ranks by what the recent window reads, so it keeps the late (axis B) region; a standard
cumulative H2O protecting the same recent window ranks by accumulated history and keeps the
early region. The stable control (all traffic on axis A) shows MorphKV's late-region retention
comes from the shift, not from a preference for recent tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from morphkv import KVCacheBuilder, KVCacheConfig

T, D, CUT = 400, 32, 280


def keys(kind: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    axis_a, axis_b = np.eye(D)[0], np.eye(D)[1]
    k = rng.standard_normal((T, D)) * 0.5
    if kind == "topic_shift":
        k[:CUT] += 3 * axis_a
        k[CUT:] += 2 * axis_b  # weaker than the early topic, plus the same noise
    else:
        k += 3 * axis_a
    return k.astype(np.float32)


def late_fraction(kind: str, method: str, seed: int) -> float:
    """Fraction of the evictable kept tokens (not sinks, not the window) from the late region."""
    config = KVCacheConfig(method=method, morphkv_budget=64, morphkv_n_sink=2, morphkv_window=8)
    cache = KVCacheBuilder.build(config)
    x = mx.array(keys(kind, seed)[None, None])
    cache.update_and_fetch(x[:, :, :100], x[:, :, :100])
    for t in range(100, T):
        cache.update_and_fetch(x[:, :, t : t + 1], x[:, :, t : t + 1])
    kept = [p for p in cache.kept_positions[0, 0] if 2 <= p < T - 8]
    return float(np.mean([p >= CUT for p in kept]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_morphkv_follows_the_window_topic_h2o_follows_history(seed):
    assert late_fraction("topic_shift", "morphkv", seed) >= 0.9
    assert late_fraction("topic_shift", "h2o", seed) <= 0.1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stable_control_morphkv_is_not_just_recency(seed):
    # no shift: MorphKV's choice is no longer the late region, unlike a recency rule
    assert late_fraction("stable", "morphkv", seed) <= 0.6
    assert late_fraction("stable", "streaming_llm", seed) == 1.0
    assert late_fraction("stable", "h2o", seed) <= 0.1  # h2o still clings to the oldest
