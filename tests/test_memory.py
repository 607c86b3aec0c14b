"""Memory: the selection state is small next to the KV it manages, and ``nbytes`` counts it.

Issue targets, checked on synthetic streams with real-query scoring: engine state <= 10% of the
kept K+V bytes at window 8 (float16 and float32 keys, 3 and 4 query heads per KV head), and a
whole cache (storage + engine) <= 1.15x mlx_lm's RotatingKVCache of the same budget."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache

from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.core.presets import tuned
from morphkv.mlxlm.hooks import queries_by_hand

H, D = 3, 64


@pytest.fixture(autouse=True)
def hook_present():
    with queries_by_hand():
        yield


def full_cache(config, dtype, groups):
    rng = np.random.default_rng(0)
    T = config.budget + 40
    keys = mx.array(rng.standard_normal((1, H, T, D)).astype(np.float32)).astype(dtype)
    queries = mx.array(rng.standard_normal((1, H * groups, T, D)).astype(np.float32))
    cache = KVCacheBuilder.build(config)
    cache.update_and_fetch(keys[:, :, :-1], keys[:, :, :-1])
    cache.prepare_attention(queries[:, :, :-1], D**-0.5, None)
    cache.update_and_fetch(keys[:, :, -1:], keys[:, :, -1:])  # a decode step
    cache.prepare_attention(queries[:, :, -1:], D**-0.5, None)
    rotating = RotatingKVCache(max_size=config.budget, keep=config.n_sink)
    rotating.update_and_fetch(keys, keys)
    return cache, rotating


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
@pytest.mark.parametrize("groups", [3, 4])
@pytest.mark.parametrize("budget", [128, 512])
def test_engine_is_small_and_counted(dtype, groups, budget):
    config = KVCacheConfig(morphkv_budget=budget, scoring="attention")
    cache, rotating = full_cache(config, dtype, groups)
    kept = cache.morphkv_kept_bytes * H
    assert cache.engine_nbytes <= 0.10 * kept
    assert cache.nbytes == cache.storage_nbytes + cache.engine_nbytes
    assert cache.nbytes <= 1.15 * rotating.nbytes


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_the_mlx_engine_holds_fixed_arrays(dtype):
    """The MLX engine keeps the window's rows in a ring at any block (no queries held): 40
    bytes per slot for the tuned MorphKV setting, at most what it holds (fixed-size arrays)."""
    for block in (1, 16):
        config = tuned(128, scoring="attention", morphkv_block=block, engine="mlx")
        cache, rotating = full_cache(config, dtype, 3)
        assert cache.engine_nbytes == H * (128 + 1) * (4 + 2 * 16 + 2 + 2)
        assert cache.engine_nbytes == cache.engine.bound_nbytes()
        assert cache.storage_nbytes == 2 * H * (128 + 1) * D * dtype.size
        assert cache.nbytes <= (1.19 if dtype == mx.float16 else 1.10) * rotating.nbytes
