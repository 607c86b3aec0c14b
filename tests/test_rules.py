"""The fast cache against the NumPy reference: random streams, chunkings, batches and ties."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import SCORERS, reference_kept

from morphkv import METHODS, KVCacheBuilder, KVCacheConfig
from morphkv.core.device import RTOL
from morphkv.core.knobs import FIELDS

RANKED = sorted(m for m in METHODS if SCORERS.get(m))  # every rule with a reference scorer


def feed(cache, keys: np.ndarray, cuts: list[int]) -> None:
    """Feed keys (B, H, T, D) in chunks ending at ``cuts``; values are the keys plus one."""
    start = 0
    for end in [*cuts, keys.shape[2]]:
        if end <= start:
            continue
        k = mx.array(keys[:, :, start:end])
        cache.update_and_fetch(k, k + 1)
        start = end


def kept_sets(cache) -> np.ndarray:
    return cache.kept_positions


@st.composite
def streams(draw, methods=tuple(RANKED)):
    method = draw(st.sampled_from(methods))
    fusion = draw(st.sampled_from(["mean", "max"]))
    window = draw(st.integers(1, 6))
    n_sink = draw(st.integers(0, 3))
    block = draw(st.sampled_from([1, 1, 2, 4]))
    budget = draw(st.integers(n_sink + window + block, n_sink + window + block + 11))
    T = draw(st.integers(1, 3 * budget + 5))
    seed = draw(st.integers(0, 2**31 - 1))
    cuts = sorted(draw(st.lists(st.integers(1, max(1, T - 1)), max_size=5)))
    discrete = draw(st.booleans())
    config = KVCacheConfig(
        method=method,
        morphkv_budget=budget,
        morphkv_n_sink=n_sink,
        morphkv_window=window,
        morphkv_fusion=fusion,
        morphkv_block=block,
    )
    rng = np.random.default_rng(seed)
    H, D = draw(st.sampled_from([(2, 8), (1, 256)]))  # (1, 256): Gemma 3's single KV head
    if discrete:  # few distinct values: many exactly tied scores
        keys = rng.integers(-2, 3, size=(2, H, T, min(D, 4) if H == 2 else D)).astype(np.float32)
    else:
        keys = rng.standard_normal((2, H, T, D)) * rng.uniform(0.5, 3) / np.sqrt(D / 8)
        keys = keys.astype(np.float32)
    return config, keys, cuts


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_fast_path_matches_reference(case):
    """Every row and head keeps what the reference keeps, unless a decision was a near-tie
    (margin <= ``device.RTOL``: the engine scores in float32, the reference in float64)."""
    config, keys, cuts = case
    cache = KVCacheBuilder.build(config)
    feed(cache, keys, cuts)
    got = kept_sets(cache)
    for b in range(keys.shape[0]):
        for h in range(keys.shape[1]):
            margins: list = []
            want = reference_kept(
                keys[b, h],
                config.method,
                config.budget,
                config.morphkv_n_sink,
                config.window,
                config.morphkv_fusion,
                block=config.block,
                margins=margins,
            )
            if min(margins, default=1.0) > RTOL:
                assert got[b, h].tolist() == want, (b, h)


@settings(max_examples=60, deadline=None)
@given(streams(methods=(*RANKED, "random")), st.data())
def test_any_chunking_keeps_the_same_set(case, data):
    config, keys, cuts = case
    one_by_one = KVCacheBuilder.build(config)
    feed(one_by_one, keys, list(range(1, keys.shape[2])))
    chunked = KVCacheBuilder.build(config)
    feed(chunked, keys, cuts)
    # rows whose decisions all lead by more than RTOL in the float64 reference (an exact tie,
    # possible with few distinct key values, is rounded differently by the chunk's replay and
    # the per-token step: hypothesis found one, max fusion over 256-dim integer keys)
    rows = [b * keys.shape[1] + h for b in range(keys.shape[0]) for h in range(keys.shape[1])
            if decisive(config, keys[b, h])]
    H = keys.shape[1]
    got, want = chunked.kept_positions, one_by_one.kept_positions
    for r in rows:
        np.testing.assert_array_equal(got[r // H, r % H], want[r // H, r % H])
    # the storage rows hold exactly the kept tokens (in position order: a chunk whose
    # evictions are scheduled gathers its kept rows, so slot order may differ)
    np.testing.assert_array_equal(by_position(chunked)[rows], by_position(one_by_one)[rows])


def decisive(config, keys: np.ndarray) -> bool:
    """Does every decision of the reference on this head's stream lead by more than RTOL
    (always, for a rule without a reference scorer: its ties are not float-made)?"""
    if not SCORERS.get(config.method):
        return True
    margins: list = []
    reference_kept(keys, config.method, config.budget, config.morphkv_n_sink, config.window,
                   config.morphkv_fusion, block=config.block, margins=margins)
    return min(margins, default=1.0) > RTOL


def by_position(cache) -> np.ndarray:
    """The stored keys (B * H, kept, D), each row's slots in position order."""
    keys = np.array(cache._fetch()[0])
    B, H, n, D = keys.shape
    order = np.argsort(np.array(cache.engine.stored_positions), axis=1)
    return np.take_along_axis(keys.reshape(B * H, n, D), order[:, :, None], axis=1)


def stored_after(t: int, config) -> int:
    """Tokens stored after t tokens: evictions of ``block`` at tokens budget + 1, budget + 1
    + block, ... (counting from 1); the tokens in between fill the freed rows."""
    if t <= config.budget:
        return t
    return config.budget + 1 - config.block + (t - config.budget - 1) % config.block


@settings(max_examples=40, deadline=None)
@given(streams(methods=(*RANKED, "random")))
def test_budget_sinks_window_and_storage_invariants(case):
    config, keys, cuts = case
    cache = KVCacheBuilder.build(config)
    start = 0
    for end in [*cuts, keys.shape[2]]:
        if end <= start:
            continue
        k = mx.array(keys[:, :, start:end])
        out_k, out_v = cache.update_and_fetch(k, k + 1)
        assert out_k.shape[2] == stored_after(start, config) + (end - start)
        start = end
        kept = cache.kept_positions
        assert kept.shape[2] == stored_after(end, config) <= config.budget
        assert cache.offset == end
        must = set(range(min(config.n_sink, end))) | set(range(max(0, end - config.window), end))
        for row in kept.reshape(-1, kept.shape[2]):
            assert must <= set(row.tolist())
            assert np.all(np.diff(row) > 0)
    # every stored row holds the key (and value) of the position the engine says it holds
    stored_k, stored_v = (np.array(a) for a in cache._fetch())
    H = keys.shape[1]
    positions = cache.engine.positions[:, : cache.engine.slots].reshape(2, H, -1)
    for b in range(2):
        for h in range(H):
            np.testing.assert_array_equal(stored_k[b, h], keys[b, h, positions[b, h]])
            np.testing.assert_array_equal(stored_v[b, h], keys[b, h, positions[b, h]] + 1)


def test_window_one_morphkv_is_tova_even_when_the_newest_scores_lowest():
    rng = np.random.default_rng(0)
    u = np.eye(8)[0]
    keys = (rng.standard_normal((1, 1, 40, 8)) + 5 * u).astype(np.float32)
    keys[0, 0, 30] = 0.1 * u  # a short key: its logit against itself is its smallest
    caches = {}
    for method in ("morphkv", "tova"):
        config = KVCacheConfig(method=method, morphkv_budget=8, morphkv_n_sink=1, morphkv_window=1)
        cache = KVCacheBuilder.build(config)
        for t in range(31):
            k = mx.array(keys[:, :, t : t + 1])
            cache.update_and_fetch(k, k)
            if t == 30:  # check the construction: the newest token's own score is the lowest
                assert cache.tokens_kept == 8  # reading the cache runs the pending step
                probs = cache.engine.newest_probs()[0]
                assert probs.argmin() == cache.engine.positions[0].tolist().index(30)
        caches[method] = cache.kept_positions
    np.testing.assert_array_equal(caches["morphkv"], caches["tova"])
    assert 30 in caches["tova"][0, 0]  # protected as the window, although it scores lowest


def test_batch_rows_are_independent():
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((2, 3, 60, 8)).astype(np.float32)
    config = KVCacheConfig(method="morphkv", morphkv_budget=12, morphkv_n_sink=2, morphkv_window=3)
    both = KVCacheBuilder.build(config)
    feed(both, keys, [17, 40])
    for b in range(2):
        alone = KVCacheBuilder.build(config)
        feed(alone, keys[b : b + 1], [5])
        np.testing.assert_array_equal(both.kept_positions[b], alone.kept_positions[0])


def test_identical_keys_tie_to_the_oldest():
    keys = np.ones((1, 1, 30, 4), np.float32)
    for method in ("morphkv", "tova", "h2o"):
        config = KVCacheConfig(method=method, morphkv_budget=10, morphkv_n_sink=2, morphkv_window=3)
        cache = KVCacheBuilder.build(config)
        feed(cache, keys, [7])
        kept = cache.kept_positions[0, 0].tolist()
        if method == "h2o":  # older tokens have accumulated more: h2o clings to them
            assert kept == [*range(7), 27, 28, 29]
        else:  # every unprotected token scores the same, so the oldest go first
            assert kept == [0, 1, *range(22, 30)], method


def test_random_is_seeded_and_deterministic():
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((1, 2, 80, 8)).astype(np.float32)
    runs = {}
    for seed in (0, 0, 1):
        config = KVCacheConfig(method="random", morphkv_budget=16, seed=seed)
        cache = KVCacheBuilder.build(config)
        feed(cache, keys, [30])
        runs.setdefault(seed, []).append(cache.kept_positions)
    np.testing.assert_array_equal(runs[0][0], runs[0][1])
    assert not np.array_equal(runs[0][0], runs[1][0])


@pytest.mark.parametrize("method", sorted(METHODS))
def test_same_stream_twice_is_deterministic(method):
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((1, 2, 70, 8)).astype(np.float32)
    config = KVCacheConfig(method=method, morphkv_budget=20, morphkv_window=4)
    a, b = KVCacheBuilder.build(config), KVCacheBuilder.build(config)
    feed(a, keys, [33])
    feed(b, keys, [33])
    np.testing.assert_array_equal(a.kept_positions, b.kept_positions)


def test_every_rule_has_a_reference_and_declares_what_it_reads():
    """A new rule (one line in ``METHODS``) is held to ``tests/reference.py`` by the property
    tests here, in test_block.py and test_device.py, which iterate over ``METHODS``."""
    assert set(METHODS) - set(SCORERS) == {"random"}  # random: its own determinism tests
    for method, rule in METHODS.items():
        built = rule.from_config(KVCacheConfig(method=method))
        assert built.window_rows in (None, "all", "newest")
        assert built.running in (None, "sum", "peak")
        assert built.attention or not (built.window_rows or built.running), method
        assert set(rule.knobs()) <= set(FIELDS), method  # a rule's knobs are config knobs


@pytest.mark.parametrize("method", RANKED)
def test_every_rule_decides_as_its_reference(method):
    """Prefill chunk then decode steps, blocks 1 and 4 (near-ties: tests/test_device.py, which
    also iterates over ``METHODS``)."""
    rng = np.random.default_rng(5)
    keys = (2 * rng.standard_normal((1, 2, 90, 16))).astype(np.float32)
    for block in (1, 4):
        config = KVCacheConfig(method=method, morphkv_budget=24, morphkv_window=3,
                               morphkv_recent=6, morphkv_block=block)
        cache = KVCacheBuilder.build(config)
        feed(cache, keys, [40, *range(41, 90)])
        for h in range(2):
            want = reference_kept(keys[0, h], method, 24, config.morphkv_n_sink, 3, recent=6,
                                  block=block)
            assert cache.kept_positions[0, h].tolist() == want, (block, h)


def test_keydiff_keeps_the_keys_that_point_elsewhere():
    """KeyDiff (key geometry alone): among keys that mostly share one direction, the few that
    point elsewhere are kept and the most typical ones go."""
    rng = np.random.default_rng(4)
    u = np.eye(16)[0]
    keys = (4 * u + 0.3 * rng.standard_normal((1, 1, 60, 16))).astype(np.float32)
    odd = [9, 23, 31]
    keys[0, 0, odd] = 3 * np.eye(16)[[1, 2, 3]]  # orthogonal to the common direction
    config = KVCacheConfig(method="keydiff", morphkv_budget=16, morphkv_n_sink=2,
                           morphkv_window=4, morphkv_block=2)
    cache = KVCacheBuilder.build(config)
    feed(cache, keys, [20, *range(21, 60)])
    kept = cache.kept_positions[0, 0].tolist()
    assert set(odd) <= set(kept) and len(kept) <= 16
    assert kept == reference_kept(keys[0, 0], "keydiff", 16, 2, 4, block=2)
