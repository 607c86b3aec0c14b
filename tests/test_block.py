"""Block eviction: the NumPy definitions of the pick and the compaction moves
(``tests/numpy_definitions.py``, what ``tests/test_device.py`` holds the engine to), and a
few cases the engine must handle: non-finite input decided alike for any chunking, a save
between evictions, half-precision queries."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.core.device import moves
from morphkv.mlxlm.hooks import queries_by_hand
from tests.numpy_definitions import compaction, pick


def run(config, keys, queries, cuts, dtype):
    cache = KVCacheBuilder.build(config)
    start = 0
    for end in [*cuts, keys.shape[2]]:
        if end <= start:
            continue
        k = mx.array(keys[:, :, start:end]).astype(dtype)
        cache.update_and_fetch(k, k + 1)
        if config.scoring == "attention":
            cache.prepare_attention(mx.array(queries[:, :, start:end]).astype(dtype), 0.35, None)
        start = end
    cache.size()  # the last update's deferred step
    return cache


@pytest.mark.parametrize("method", ["morphkv", "tova", "h2o", "peak"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_keys_and_queries_decide_alike_for_any_chunking(method, bad):
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((1, 2, 40, 8)).astype(np.float32)
    queries = rng.standard_normal((1, 4, 40, 8)).astype(np.float32)
    keys[0, 1, 25, 3] = bad  # a decode step's key
    queries[0, 0, 31, 2] = bad  # a decode step's query
    config = KVCacheConfig(method=method, morphkv_budget=16, morphkv_window=3,
                           morphkv_block=4, scoring="attention")
    with queries_by_hand(), np.errstate(all="ignore"):
        fed = run(config, keys, queries, list(range(20, 40)), mx.float32)
        whole = run(config, keys, queries, [], mx.float32)
    np.testing.assert_array_equal(fed.kept_positions, whole.kept_positions)


def test_pick_takes_successive_lowest_with_ties_to_the_oldest():
    scores = np.array([[3.0, 1.0, 1.0, np.inf, 0.5, 1.0 + 1e-12]])
    positions = np.array([[10, 7, 5, 0, 9, 2]])
    assert pick(scores, positions, 4).tolist() == [[4, 5, 2, 1]]


def test_compaction_moves_live_rows_down_into_holes():
    rng = np.random.default_rng(1)
    n = 20
    for block in [1, 2, 6] * 70:
        victims = np.stack([rng.choice(n, block, replace=False) for _ in range(3)])
        src, dst = compaction(victims, n, block)
        for r in range(3):
            rows = np.arange(n)
            rows[dst[r]] = rows[src[r]]
            assert set(rows[: n - block]) == set(range(n)) - set(victims[r])
        src2, dst2 = moves(mx.array(victims.astype(np.uint32)), n, block)  # the engine's
        assert (np.array(src2) == src).all() and (np.array(dst2) == dst).all()


@pytest.mark.parametrize("extra", [dict(morphkv_peak=0.5, morphkv_value=True),
                                   dict(morphkv_window=6), dict(method="h2o")])
def test_a_save_mid_block_continues_identically(extra, tmp_path):
    """A cache saved between evictions and loaded again makes the decisions of the one that
    kept going."""
    from mlx_lm.models import cache as mlx_cache

    rng = np.random.default_rng(4)
    keys = rng.standard_normal((1, 2, 90, 8)).astype(np.float32)
    queries = rng.standard_normal((1, 4, 90, 8)).astype(np.float32)
    config = KVCacheConfig(**{**dict(method="morphkv", morphkv_budget=24, morphkv_window=3,
                                     morphkv_recent=8, morphkv_block=5, scoring="attention"),
                              **extra})
    with queries_by_hand():
        cache = run(config, keys[:, :, :43], queries[:, :, :43], [30, 41], mx.float32)
        path = str(tmp_path / "c.safetensors")
        mlx_cache.save_prompt_cache(path, [cache])
        loaded = mlx_cache.load_prompt_cache(path)[0]
        for c in (cache, loaded):
            for t in range(43, 90):
                k = mx.array(keys[:, :, t : t + 1])
                c.update_and_fetch(k, k + 1)
                c.prepare_attention(mx.array(queries[:, :, t : t + 1]), 0.35, None)
    np.testing.assert_array_equal(loaded.kept_positions, cache.kept_positions)


@pytest.mark.parametrize("kd, qd", [(mx.float16, mx.float16), (mx.float32, mx.float16),
                                    (mx.bfloat16, mx.bfloat16)])
def test_half_precision_queries_and_keys_settle(kd, qd):
    """float16/bfloat16 queries (a float16 model's): the cache evicts and states its bound."""
    from morphkv.core.cache import MorphKVCache
    from morphkv.core.presets import recommended
    from morphkv.core.queries import queries_by_hand

    with queries_by_hand():
        cache = MorphKVCache(recommended(40))
        for _ in range(60):
            k = mx.random.normal((1, 3, 1, 64)).astype(kd)
            cache.update_and_fetch(k, k)
            cache.prepare_attention(mx.random.normal((1, 9, 1, 64)).astype(qd), 0.125, None)
        assert cache.tokens_seen == 60 and cache.tokens_kept <= 40
        assert cache.nbytes <= cache.nbytes_bound
