"""The mlx_lm cache contract: offsets, masks, state, save/load, copies, bad input, generation."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache

from morphkv import METHODS, KVCacheBuilder, KVCacheConfig, patch_model, unpatch_model
from morphkv.eval.models import greedy_tokens, tiny_llama

SMALL = dict(morphkv_budget=12, morphkv_n_sink=2, morphkv_window=3)


def random_kv(T=40, B=1, H=2, D=8, dtype=mx.float32, seed=0):
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32)).astype(dtype)
    return k, v


# ---- config --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="nope"), "valid methods"),
        (
            dict(morphkv_budget=7, morphkv_n_sink=4, morphkv_window=3),
            r"morphkv_budget must exceed n_sink \+ window",
        ),
        (dict(morphkv_window=0), "morphkv_window must be >= 1"),
        (dict(morphkv_n_sink=-1), "morphkv_n_sink must be >= 0"),
        (dict(morphkv_fusion="median"), "morphkv_fusion"),
        (dict(scoring="oracle"), "scoring"),
    ],
)
def test_bad_config_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCacheBuilder.build(KVCacheConfig(**kwargs))


def test_sliding_window_needs_no_sink_room():
    KVCacheBuilder.build(KVCacheConfig(method="sliding_window", morphkv_budget=5, morphkv_window=4))


# ---- offsets, storage, masks ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_dtype_kept_and_offset_counts_every_token(dtype):
    k, v = random_kv(dtype=dtype)
    cache = KVCacheBuilder.build(KVCacheConfig(**SMALL))
    out_k, out_v = cache.update_and_fetch(k[:, :, :25], v[:, :, :25])
    assert out_k.dtype == dtype and out_v.dtype == dtype
    for t in range(25, 40):
        cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert cache.offset == cache.tokens_seen == 40
    assert cache.tokens_kept == cache.size() == 12
    assert cache.keys.dtype == dtype
    assert cache.morphkv_kept_bytes == 12 * 16 * dtype.size
    assert cache.full_seq_bytes == 40 * 16 * dtype.size
    assert cache.compression_ratio == pytest.approx(40 / 12)
    # engine state (proxy rows: positions only; the window's rows are recomputed at each
    # eviction): within its bound
    assert 0 < cache.engine_nbytes <= cache.engine.bound_nbytes()


def test_survivors_keep_their_rotation():
    """Stored rows are the exact keys passed in at their positions (RoPE is never redone)."""
    k, v = random_kv(T=50)
    cache = KVCacheBuilder.build(KVCacheConfig(**SMALL))
    cache.update_and_fetch(k[:, :, :20], v[:, :, :20])
    for t in range(20, 50):
        cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    kept = cache.kept_positions
    stored_k, stored_v = (np.array(a) for a in cache._fetch())
    pos = np.array(cache.engine.positions)[:, : cache.engine.slots].reshape(1, 2, -1)
    for h in range(2):
        live = np.isin(pos[0, h], kept[0, h])
        np.testing.assert_array_equal(stored_k[0, h][live], np.array(k)[0, h, pos[0, h][live]])
        np.testing.assert_array_equal(stored_v[0, h][live], np.array(v)[0, h, pos[0, h][live]])


def test_make_mask_matches_returned_layout():
    k, v = random_kv(T=40)
    cache = KVCacheBuilder.build(KVCacheConfig(**SMALL))
    cache.update_and_fetch(k[:, :, :30], v[:, :, :30])
    assert cache.make_mask(1) is None
    assert cache.make_mask(5) == "causal"
    mask = cache.make_mask(5, return_array=True)
    out_k, _ = cache.update_and_fetch(k[:, :, 30:35], v[:, :, 30:35])
    assert mask.shape == (5, out_k.shape[2])
    # query i sees every stored key and chunk keys up to itself
    np.testing.assert_array_equal(np.array(mask), np.tril(np.ones((5, 17), bool), k=12))
    with pytest.raises(NotImplementedError, match="sliding-window"):
        cache.make_mask(3, window_size=4)


# ---- bad input loses nothing ---------------------------------------------------------------
def snapshot(cache):
    kept = cache.kept_positions.copy()  # reading it first runs any pending engine step
    k, v = cache._fetch()
    return (np.array(k), np.array(v), kept, cache.offset)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda k, v: (k[:, :1], v[:, :1]), "n_kv_heads"),
        (lambda k, v: (mx.concatenate([k, k]), mx.concatenate([v, v])), "batch"),
        (lambda k, v: (k[..., :4], v[..., :4]), "head_dim"),
        (lambda k, v: (k.astype(mx.float16), v.astype(mx.float16)), "dtype"),
        (lambda k, v: (k, v[:, :, :1]), "disagree"),
        (lambda k, v: (k[0], v[0]), "must be"),
    ],
)
def test_bad_update_raises_and_leaves_cache_unchanged(bad, message):
    k, v = random_kv(T=30)
    cache = KVCacheBuilder.build(KVCacheConfig(**SMALL))
    cache.update_and_fetch(k[:, :, :20], v[:, :, :20])
    before = snapshot(cache)
    with pytest.raises(ValueError, match=message):
        cache.update_and_fetch(*bad(k[:, :, 20:22], v[:, :, 20:22]))
    after = snapshot(cache)
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)


def test_zero_token_update_is_a_noop():
    k, v = random_kv(T=20)
    cache = KVCacheBuilder.build(KVCacheConfig(**SMALL))
    empty_k, _ = cache.update_and_fetch(k[:, :, :0], v[:, :, :0])
    assert empty_k.shape[2] == 0 and cache.empty()
    cache.update_and_fetch(k, v)
    before = snapshot(cache)
    out_k, _ = cache.update_and_fetch(k[:, :, :0], v[:, :, :0])
    assert out_k.shape[2] == 12
    for x, y in zip(before, snapshot(cache), strict=True):
        np.testing.assert_array_equal(x, y)


def test_config_head_dim_must_match_keys():
    k, v = random_kv(D=8)
    cache = KVCacheBuilder.build(KVCacheConfig(head_dim=16, **SMALL))
    with pytest.raises(ValueError, match="head_dim 8 but config.head_dim=16"):
        cache.update_and_fetch(k, v)
    assert cache.empty()


@pytest.mark.parametrize("method", ["morphkv", "h2o", "tova"])
def test_non_finite_keys_do_not_crash_and_are_deterministic(method):
    k, v = random_kv(T=40)
    bad = np.array(k)
    bad[0, 0, 5] = np.nan
    bad[0, 1, 9] = np.inf
    bad[0, 0, 20] = -np.inf
    runs = []
    for cuts in ([40], [7, 8, 33]):
        cache = KVCacheBuilder.build(KVCacheConfig(method=method, **SMALL))
        start = 0
        for end in cuts + [40]:
            if end > start:
                cache.update_and_fetch(mx.array(bad[:, :, start:end]), v[:, :, start:end])
            start = end
        runs.append(cache.kept_positions)
        assert cache.tokens_kept == 12
    np.testing.assert_array_equal(runs[0], runs[1])


# ---- persistence ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", sorted(METHODS))
def test_save_load_continues_bit_identically(method, tmp_path):
    k, v = random_kv(T=60, dtype=mx.float16)
    config = KVCacheConfig(method=method, **SMALL)
    caches = [KVCacheBuilder.build(config) for _ in range(2)]
    for c in caches:
        c.update_and_fetch(k[:, :, :25], v[:, :, :25])
        c.update_and_fetch(k[:, :, 25:26], v[:, :, 25:26])  # leaves a slot awaiting reuse
    path = str(tmp_path / "cache.safetensors")
    mlx_cache.save_prompt_cache(path, caches + [KVCacheBuilder.build(config)])
    loaded = mlx_cache.load_prompt_cache(path)
    assert type(loaded[0]).__name__ == "MorphKVCache" and loaded[2].empty()
    deep = copy.deepcopy(caches[1])
    for t in range(26, 60):
        outs = [
            c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
            for c in (caches[0], loaded[0], deep)
        ]
        for out in outs[1:]:
            np.testing.assert_array_equal(np.array(out[0]), np.array(outs[0][0]))
            np.testing.assert_array_equal(np.array(out[1]), np.array(outs[0][1]))
    for other in (loaded[0], deep):
        np.testing.assert_array_equal(other.kept_positions, caches[0].kept_positions)
        assert other.offset == caches[0].offset == 60
    assert not hasattr(loaded[0], "bits")


def test_not_trimmable():
    cache = KVCacheBuilder.build(KVCacheConfig(**SMALL))
    assert not cache.is_trimmable() and cache.trim(3) == 0
    assert not mlx_cache.can_trim_prompt_cache([cache])


# ---- real mlx_lm generation ----------------------------------------------------------------
@pytest.mark.parametrize("method", sorted(METHODS))
def test_mlx_lm_generation_end_to_end_with_chunked_prefill(method):
    model = tiny_llama()
    config = KVCacheConfig(method=method, morphkv_budget=24, morphkv_n_sink=2, morphkv_window=4)
    caches = KVCacheBuilder.for_model(model, config)
    assert len(caches) == 2 and caches[0].config.head_dim == 16
    prompt = list(range(1, 60))
    tokens = greedy_tokens(model, caches, prompt, max_tokens=20, prefill_step_size=16)
    assert len(tokens) == 20
    assert caches[0].tokens_seen >= len(prompt)
    if method != "full":
        assert caches[0].tokens_kept == 24 and caches[1].kept_positions.shape == (1, 2, 24)


def test_patch_model_builds_fresh_caches_every_time():
    model = tiny_llama()
    patch_model(model, KVCacheConfig(**SMALL))
    first, second = mlx_cache.make_prompt_cache(model), mlx_cache.make_prompt_cache(model)
    assert type(first[0]).__name__ == "MorphKVCache"
    assert first[0] is not second[0]
    tokens = mx.array([list(range(1, 30))])
    a = model(tokens, cache=first)
    b = model(tokens, cache=mlx_cache.make_prompt_cache(model))
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)
    unpatch_model(model)
    assert type(mlx_cache.make_prompt_cache(model)[0]).__name__ == "KVCache"


def test_full_method_matches_mlx_lm_kvcache_logits():
    model = tiny_llama()
    tokens = mx.array([list(range(3, 70))])
    ours = KVCacheBuilder.for_model(model, KVCacheConfig(method="full"))
    theirs = mlx_cache.make_prompt_cache(model)
    for chunk in (tokens[:, :30], tokens[:, 30:31], tokens[:, 31:]):
        a, b = model(chunk, cache=ours), model(chunk, cache=theirs)
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)
