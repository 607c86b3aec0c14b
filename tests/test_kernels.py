"""The compiled kernels (``morphkv.core.kernels``) against the engine's generic NumPy path.

Every rule the kernels know is run both ways on random and tied streams, with real queries and
any chunking: kept sets, attention rows (bit for bit) and running scores must agree. The
float16 conversions are checked on every bit pattern and every rounding midpoint.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numba import njit

from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.core import kernels
from morphkv.core.engine import Engine
from morphkv.core.fused import fused_code
from morphkv.mlxlm.hooks import queries_by_hand


@njit
def _bits(x):
    out = np.empty(x.size, np.uint16)
    kernels._to_half(x, x.size, out)
    return out


@njit
def _values(b):
    out = np.empty(b.size)
    for i in range(b.size):
        out[i] = kernels.half_value(b[i])
    return out


@njit
def _exp(x):
    out, scratch = np.empty(x.size), np.empty(x.size)
    kernels._exp_shifted(x, x.size, 0.0, out, scratch)
    return out


def test_float16_rounding_matches_numpy_everywhere():
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
    assert np.array_equal(_bits(x), want)
    every = np.arange(2**16, dtype=np.uint16)
    got, want = _values(every), every.view(np.float16).astype(np.float64)
    assert np.array_equal(got, want, equal_nan=True)


def test_exp_is_within_one_ulp_of_numpy():
    x = -np.abs(np.random.default_rng(1).standard_normal(10**5) * 40)
    x = np.concatenate([x, [0.0, -1e-300, -700.0, -np.inf]])
    got, want = _exp(x), np.exp(x)
    live = x > -700.0
    assert (np.abs(got[live] - want[live]) <= np.spacing(want[live])).all()
    assert got[-1] == 0.0


FUSED = ["streaming_llm", "sliding_window", "h2o", "tova", "morphkv", "peak"]
# (KV heads, head dim): a small llama-like layout and Gemma 3's one KV head of 256 dims
KV_LAYOUTS = [(2, 8), (1, 256)]


@st.composite
def cases(draw):
    method = draw(st.sampled_from(FUSED))
    window = draw(st.integers(1, 5))
    recent = draw(st.integers(window, window + 5))
    n_sink = draw(st.integers(0, 3))
    budget = draw(st.integers(n_sink + recent + 1, n_sink + recent + 12))
    attention = method in ("h2o", "tova", "morphkv", "peak")
    peak = draw(st.sampled_from([0.0, 0.02, 0.5])) if method in ("tova", "morphkv") else 0.0
    persists = peak > 0 or method == "peak"
    config = KVCacheConfig(
        method=method,
        morphkv_budget=budget,
        morphkv_n_sink=n_sink,
        morphkv_window=window,
        morphkv_recent=recent,
        morphkv_fusion=draw(st.sampled_from(["mean", "max"])),
        morphkv_value=attention and draw(st.booleans()),
        morphkv_peak=peak,
        morphkv_decay=draw(st.sampled_from([1.0, 0.9])) if persists else 1.0,
        scoring="attention",
    )
    T = draw(st.integers(1, 3 * budget + 6))
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
        cache.prepare_attention(mx.array(queries[:, :, start:end]).astype(dtype), 0.35, None)
        start = end
    return cache


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_kernels_decide_as_the_generic_path(case):
    with queries_by_hand():
        fast = run(*case)
        Engine.kernels = False
        try:
            slow = run(*case)
        finally:
            Engine.kernels = True
    assert fast.engine.fused is not None and slow.engine.fused is None
    assert np.array_equal(fast.kept_positions, slow.kept_positions)
    f, s = fast.engine, slow.engine
    assert (f.seen, f.slots, f.head, f.capacity) == (s.seen, s.slots, s.head, s.capacity)
    assert np.array_equal(f.positions, s.positions)
    assert (f.dead is None) == (s.dead is None)
    if f.attention is not None:
        assert np.array_equal(f.attention.ring, s.attention.ring)
    if f.accumulated is not None:
        assert np.array_equal(f.accumulated, s.accumulated)


def test_unknown_rules_use_their_own_score():
    """A rule the kernels do not know (here: random; a subclass of a known rule too) runs
    through score()."""
    cache = KVCacheBuilder.build(KVCacheConfig(method="random", morphkv_budget=16))
    k = mx.zeros((1, 1, 3, 4))
    cache.update_and_fetch(k, k)
    assert cache.engine.fused is None
    from morphkv.core import rules

    class Shifted(rules.WindowAttention):
        def score(self, engine):
            return super().score(engine) + 1.0

    assert fused_code(Shifted()) is None
    assert fused_code(rules.WindowAttention()) == kernels.MEAN


@pytest.mark.parametrize("method", ["morphkv", "h2o"])
def test_proxy_rows_stay_on_the_generic_path(method):
    cache = KVCacheBuilder.build(KVCacheConfig(method=method, morphkv_budget=16, scoring="proxy"))
    k = mx.ones((1, 1, 3, 4))
    cache.update_and_fetch(k, k)
    assert cache.engine.fused is None


@pytest.mark.parametrize("method", ["morphkv", "h2o", "tova"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_keys_and_queries_decide_as_the_generic_path(method, bad):
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((1, 2, 40, 8)).astype(np.float32)
    queries = rng.standard_normal((1, 4, 40, 8)).astype(np.float32)
    keys[0, 1, 25, 3] = bad  # a decode step's key
    queries[0, 0, 31, 2] = bad  # a decode step's query
    config = KVCacheConfig(method=method, morphkv_budget=16, morphkv_window=3,
                           scoring="attention")
    cuts = list(range(20, 40))
    with queries_by_hand(), np.errstate(invalid="ignore", over="ignore"):
        fast = run(config, keys, queries, cuts, mx.float32)
        Engine.kernels = False
        try:
            slow = run(config, keys, queries, cuts, mx.float32)
        finally:
            Engine.kernels = True
    assert not fast.engine.finite and not slow.engine.finite
    assert np.array_equal(fast.kept_positions, slow.kept_positions)
    assert np.array_equal(fast.engine.attention.ring, slow.engine.attention.ring)
