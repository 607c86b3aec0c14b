"""Block eviction on the host engine (``engine="host"``, the float64 reference the MLX engine
is held to in ``tests/test_device.py``): any chunking makes the decisions token-by-token
feeding makes with the same block (kept sets, slot layout, attention rows bit for bit,
running scores), for every rule, real queries or none, float16 and float32, tied streams,
NaN/inf input; and a decode step between evictions reads nothing on the host."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.core import kernels
from morphkv.core.rules import METHODS
from morphkv.mlxlm.hooks import queries_by_hand
from tests.chunked import draw_config
from tests.numpy_definitions import causal_rows_numpy, compaction, pick

EVICTING = sorted(set(METHODS) - {"full"})


# (KV heads, head dim): a small llama-like layout and Gemma 3's one KV head of 256 dims
KV_LAYOUTS = [(2, 8), (1, 256)]


@st.composite
def cases(draw):
    config = draw_config(draw, EVICTING, [1, 2, 3, 8], slack=10, engine="host")
    budget, block = config.budget, config.morphkv_block
    T = draw(st.integers(1, 3 * budget + 2 * block))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    G = draw(st.integers(1, 4))
    H, D = draw(st.sampled_from(KV_LAYOUTS))
    if draw(st.booleans()):  # few distinct values: exact ties everywhere
        keys = rng.integers(-2, 3, size=(1, H, T, D)).astype(np.float32)
        queries = rng.integers(-1, 2, size=(1, H * G, T, D)).astype(np.float32)
    else:
        keys = rng.standard_normal((1, H, T, D)).astype(np.float32) * 2 / np.sqrt(D / 8)
        queries = rng.standard_normal((1, H * G, T, D)).astype(np.float32)
    dtype = draw(st.sampled_from([mx.float32, mx.float16]))
    cuts = sorted(draw(st.lists(st.integers(1, max(1, T - 1)), max_size=4)))
    return config, keys, queries, cuts, dtype


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
    if cache.engine is not None:  # norms are computed at arrival (chunks) or at a settle
        cache.engine.fill_norms(cache._host_values())
    return cache


def same_state(a, b) -> None:
    np.testing.assert_array_equal(a.kept_positions, b.kept_positions)
    e, f = a.engine, b.engine
    assert (e.seen, e.slots, e.pending_count) == (f.seen, f.slots, f.pending_count)
    n = e.slots
    np.testing.assert_array_equal(e.positions[:, :n], f.positions[:, :n])  # the same layout
    np.testing.assert_array_equal(np.array(a._fetch()[0]), np.array(b._fetch()[0]))
    if e.value_norms is not None:
        np.testing.assert_array_equal(e.value_norms[:, :n], f.value_norms[:, :n])
    if e.accumulated is not None:  # real rows are float16 (exact sums); proxy rows float64,
        tol = 0 if e.real else 1e-12  # whose sums may differ by ulps with the batching
        np.testing.assert_allclose(e.accumulated[:, :n], f.accumulated[:, :n], rtol=tol)
    if e.ring is not None:
        np.testing.assert_array_equal(e.ring[..., :n], f.ring[..., :n])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_any_chunking_decides_as_token_by_token_with_the_same_block(case):
    config, keys, queries, cuts, dtype = case
    with queries_by_hand(), np.errstate(all="ignore"):
        chunked = run(config, keys, queries, cuts, dtype)
        one_by_one = run(config, keys, queries, list(range(1, keys.shape[2])), dtype)
    same_state(chunked, one_by_one)
    kept = chunked.kept_positions.shape[2]
    assert kept <= config.budget


@pytest.mark.parametrize("method", ["morphkv", "h2o", "tova", "peak"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_keys_and_queries_decide_alike_for_any_chunking(method, bad):
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((1, 2, 40, 8)).astype(np.float32)
    queries = rng.standard_normal((1, 4, 40, 8)).astype(np.float32)
    keys[0, 1, 25, 3] = bad  # a decode step's key
    queries[0, 0, 31, 2] = bad  # a decode step's query
    config = KVCacheConfig(engine="host", method=method, morphkv_budget=16, morphkv_window=3,
                           morphkv_block=4, scoring="attention")
    with queries_by_hand(), np.errstate(all="ignore"):
        fed = run(config, keys, queries, list(range(20, 40)), mx.float32)
        whole = run(config, keys, queries, [], mx.float32)
    assert not fed.engine.finite and not whole.engine.finite
    same_state(fed, whole)


@pytest.mark.parametrize("block", [1, 4, 8])
def test_decode_reads_the_host_only_at_evictions(block):
    """Between evictions a decode step writes its key/value and keeps its query: the stored
    keys are read on the host once per eviction (every ``block`` tokens) and never between."""
    rng = np.random.default_rng(0)
    T, budget = 120, 32
    keys = rng.standard_normal((1, 2, T, 8)).astype(np.float32)
    queries = rng.standard_normal((1, 4, T, 8)).astype(np.float32)
    config = KVCacheConfig(engine="host", method="morphkv", morphkv_budget=budget, morphkv_window=4,
                           morphkv_recent=8, morphkv_block=block, scoring="attention")
    with queries_by_hand():
        cache = run(config, keys[:, :, :40], queries[:, :, :40], [], mx.float32)
        reads = []
        cache.engine.stored_keys = lambda: reads.append(1) or cache._host_keys()
        settle = cache.engine.settle
        cache.engine.settle = lambda *a: reads.append(1) or settle(*a)
        for t in range(40, T):
            k = mx.array(keys[:, :, t : t + 1])
            cache.update_and_fetch(k, k + 1)
            assert isinstance(cache._fetch()[0], mx.array)
            cache.prepare_attention(mx.array(queries[:, :, t : t + 1]), 0.35, None)
            cache.size()  # this step's deferred work: nothing read unless it evicts
            pending = cache.engine.pending
            assert not pending or isinstance(pending[-1][0], mx.array)  # kept, not read
        cache._flush()
    assert len(reads) == (T - 40) // block  # one per eviction (and per block pending)


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
        src2, dst2 = np.empty_like(victims), np.empty_like(victims)
        kernels.moves(victims, n, src2, dst2)  # the compiled moves are the definition's
        assert (src2 == src).all() and (dst2 == dst).all()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 3), st.integers(0, 2**31 - 1), st.booleans())
def test_pick_kernel_is_the_numpy_definition(n, rows, seed, tied):
    rng = np.random.default_rng(seed)
    block = int(rng.integers(1, n + 1))
    scores = rng.integers(0, 3, (rows, n)).astype(float) if tied else rng.random((rows, n))
    scores[rng.random((rows, n)) < 0.2] = np.inf
    scores *= 1.0 + rng.choice([0.0, 1e-12, 1e-6], (rows, n))
    positions = np.stack([rng.permutation(1000)[:n] for _ in range(rows)])
    out = np.empty((rows, block), np.int64)
    kernels.pick(scores, positions, block, out)
    assert out.tolist() == pick(scores, positions, block).tolist()


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 40), st.integers(1, 17), st.integers(0, 2**31 - 1))
def test_half_mean_kernel_is_the_numpy_mean(n, window, seed):
    rng = np.random.default_rng(seed)
    rows = (rng.random((2, window, n)) ** rng.integers(1, 30) * 3).astype(np.float16)
    rows[rng.random(rows.shape) < 0.1] = 0.0
    out = np.empty((2, n))
    kernels.half_mean(rows.view(np.uint16), out)
    assert np.array_equal(out, rows.sum(axis=1, dtype=np.float64) / window)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 30), st.integers(1, 6), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_rows_kernel_is_the_numpy_definition(n, P, G, seed):
    from morphkv.core.rows import causal_rows

    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((2, n, 8)) * 3
    queries = rng.standard_normal((2, P, G, 8))
    slots = np.sort(rng.integers(0, n, P))
    want = causal_rows_numpy(queries, keys, slots, 0.35, True, 1e308)
    got = causal_rows(queries, keys, slots, 0.35, True, 1e308, half=False)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-300)
    halves = causal_rows(queries, keys, slots, 0.35, True, 1e308, half=True)
    np.testing.assert_array_equal(halves, got.astype(np.float16))


def test_float16_rounding_matches_numpy_everywhere():
    from numba import njit

    from morphkv.core import kernels

    @njit
    def bits(x):
        out = np.empty(x.size, np.uint16)
        kernels._to_half(x, x.size, out)
        return out

    halves = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    middle = (halves[1:] + halves[:-1]) / 2  # ties: to even
    rng = np.random.default_rng(0)
    x = np.concatenate([
        halves, middle, np.nextafter(middle, 0), np.nextafter(middle, 1e9),
        rng.uniform(0, 4, 10**5), np.exp(rng.uniform(-60, 11, 10**5)),
        [0.0, 5e-324, 2.0**-25, 65504.0, 65519.99, 65520.0, 1e300],
    ])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(bits(x), want)


@pytest.mark.parametrize("extra", [dict(morphkv_peak=0.5, morphkv_value=True),
                                   dict(morphkv_window=6), dict(method="h2o")])
def test_a_save_mid_block_continues_identically(extra, tmp_path):
    """Pending queries travel with the saved state: a cache saved between evictions and
    loaded again makes the decisions of the one that kept going."""
    from mlx_lm.models import cache as mlx_cache

    rng = np.random.default_rng(4)
    keys = rng.standard_normal((1, 2, 90, 8)).astype(np.float32)
    queries = rng.standard_normal((1, 4, 90, 8)).astype(np.float32)
    config = KVCacheConfig(engine="host", **{**dict(method="morphkv", morphkv_budget=24,
                                                    morphkv_window=3,
                                     morphkv_recent=8, morphkv_block=5, scoring="attention"),
                              **extra})
    with queries_by_hand():
        cache = run(config, keys[:, :, :43], queries[:, :, :43], [30, 41], mx.float32)
        assert cache.engine.pending_count > 0
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
    """float16/bfloat16 queries (a float16 model's) reach the host rows without a float16
    kernel signature: the cache evicts and states its bound."""
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
