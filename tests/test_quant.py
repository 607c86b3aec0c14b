"""Quantized storage (kv_bits): every method through real mlx_lm generation, exact chunks,
persistence, mlx_lm's kv_bits conversion, real byte accounting, kept-set fidelity."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache

import morphkv
from morphkv import METHODS, KVCacheBuilder, KVCacheConfig
from morphkv.core import quant
from morphkv.eval.models import greedy_tokens, tiny_llama

CONFIG = dict(morphkv_budget=20, morphkv_n_sink=2, morphkv_window=4)
PROMPT = mx.array([[(7 * i + 3) % 251 + 1 for i in range(70)]])


def tiny_llama_hd64(seed: int = 1):
    """A tiny random-weight llama with head_dim 64 (MLX quantizes groups of 32/64/128)."""
    return tiny_llama(seed, head_dim=64)


@pytest.fixture(scope="module")
def model():
    model = tiny_llama_hd64()
    yield morphkv.attach(model)
    morphkv.detach(model)


def random_kv(T=60, H=2, D=64, dtype=mx.float16, seed=0):
    rng = np.random.default_rng(seed)
    k, v = rng.standard_normal((2, 1, H, T, D)).astype(np.float32)
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def run(model, config, step):
    caches = KVCacheBuilder.for_model(model, config)
    outs = [model(PROMPT[:, i : i + step], cache=caches) for i in range(0, PROMPT.shape[1], step)]
    return np.array(mx.concatenate(outs, axis=1)), caches


# ---- every method, 8 and 4 bits, through the model and mlx_lm generation -------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_chunked_prefill_equals_token_by_token_and_generates(model, method, bits):
    config = KVCacheConfig(method=method, kv_bits=bits, **CONFIG)
    want, want_caches = run(model, config, 1)
    assert hasattr(want_caches[0], "bits") and want_caches[0].bits == bits
    for step in (16, 70):
        got, caches = run(model, config, step)
        # decisions are exact (kept sets equal); logits are close, not 1e-6 close: the model
        # computes a chunk's keys with float32 rounding differences (1e-7), and a key element
        # on a quantization boundary then lands one level (~1e-2) apart, as in mlx_lm's own
        # QuantizedKVCache. A wrong mask or lost row moves logits by ~1.
        np.testing.assert_allclose(got, want, atol=1e-2, rtol=1e-3, err_msg=f"chunks of {step}")
        for a, b in zip(caches, want_caches, strict=True):
            np.testing.assert_array_equal(a.kept_positions, b.kept_positions)
            assert isinstance(a.keys, tuple) and a.keys[0].dtype == mx.uint32
    caches = KVCacheBuilder.for_model(model, config)
    tokens = greedy_tokens(model, caches, list(range(1, 60)), max_tokens=12, prefill_step_size=16)
    assert len(tokens) == 12
    if method != "full":
        assert caches[0].tokens_kept == 20 and caches[1].kept_positions.shape == (1, 2, 20)


def test_quantized_attention_is_close_to_float(model):
    """Without eviction (budget above the stream) 8-bit storage changes logits only a little."""
    big = dict(CONFIG, morphkv_budget=100)
    want, _ = run(model, KVCacheConfig(method="morphkv", **big), 70)
    got, _ = run(model, KVCacheConfig(method="morphkv", kv_bits=8, **big), 70)
    assert 0 < np.abs(got - want).max() < 0.05 * np.abs(want).max()


# ---- persistence ---------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_save_load_and_deepcopy_continue_bit_identically(method, bits, tmp_path):
    k, v = random_kv()
    config = KVCacheConfig(method=method, kv_bits=bits, scoring="proxy", **CONFIG)
    cache = KVCacheBuilder.build(config)
    cache.update_and_fetch(k[:, :, :25], v[:, :, :25])
    cache.update_and_fetch(k[:, :, 25:26], v[:, :, 25:26])  # leaves a slot awaiting reuse
    path = str(tmp_path / "cache.safetensors")
    mlx_cache.save_prompt_cache(path, [cache, KVCacheBuilder.build(config)])
    loaded, empty = mlx_cache.load_prompt_cache(path)
    assert empty.empty() and (loaded.bits, loaded.group_size) == (bits, 64)
    deep = copy.deepcopy(cache)
    for t in range(26, 60):
        outs = [
            c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
            for c in (cache, loaded, deep)
        ]
        for out in outs[1:]:
            for got, want in zip(out[0] + out[1], outs[0][0] + outs[0][1], strict=True):
                np.testing.assert_array_equal(np.array(got), np.array(want))
    for other in (loaded, deep):
        np.testing.assert_array_equal(other.kept_positions, cache.kept_positions)
        assert other.offset == 60


def test_mlx_lm_save_load_quantized_cache_logic(tmp_path):
    """mlx_lm's test_save_load_quantized_cache (tests/test_prompt_cache.py), on MorphKVCache:
    4 bits, group 32, (1, 8, 10, 32) updates; bits, group size, offset and every stored array
    survive. (Its ``state[0][i]`` indexing is QuantizedKVCache's layout; ours is compared
    array by array.)"""
    config = KVCacheConfig(method="morphkv", kv_bits=4, kv_group_size=32, scoring="proxy", **CONFIG)
    cache = [KVCacheBuilder.build(config) for _ in range(4)]
    for c in cache:
        x = mx.random.uniform(shape=(1, 8, 10, 32))
        c.update_and_fetch(x, x)
    path = str(tmp_path / "prompt_cache.safetensors")
    mlx_cache.save_prompt_cache(path, cache, {"a": "b"})
    loaded, metadata = mlx_cache.load_prompt_cache(path, return_metadata=True)
    assert metadata == {"a": "b"} and len(loaded) == 4
    for c, lc in zip(cache, loaded, strict=True):
        assert (
            (lc.bits, lc.group_size, lc.offset) == (c.bits, c.group_size, c.offset) == (4, 32, 10)
        )
        for a, b in zip(c.state[1:], lc.state[1:], strict=True):
            assert a == b if isinstance(a, str) else mx.array_equal(a, b)


@pytest.mark.parametrize("edit", ["drop_part", "wrong_bits", "float_parts"])
def test_edited_quantized_state_is_rejected_unchanged(edit):
    k, v = random_kv()
    cache = KVCacheBuilder.build(KVCacheConfig(kv_bits=8, scoring="proxy", **CONFIG))
    cache.update_and_fetch(k[:, :, :30], v[:, :, :30])
    state = list(cache.state)
    if edit == "drop_part":
        del state[3]
    elif edit == "wrong_bits":
        state[0] = state[0].replace('"kv_bits": 8', '"kv_bits": 4')
    else:
        state[1] = state[1].astype(mx.float32)
    target = KVCacheBuilder.build(KVCacheConfig(scoring="proxy", **CONFIG))
    with pytest.raises(ValueError, match="saved cache"):
        target.state = state
    assert target.empty() and not hasattr(target, "bits")


# ---- mlx_lm's kv_bits= converts morphkv caches ---------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
def test_generate_step_kv_bits_converts_caches(model, bits):
    config = KVCacheConfig(method="morphkv", **CONFIG)
    caches = KVCacheBuilder.for_model(model, config)
    steps = generate_step(
        PROMPT[0, :40],
        model,
        prompt_cache=caches,
        max_tokens=10,
        kv_bits=bits,
        kv_group_size=64,
        quantized_kv_start=0,
        prefill_step_size=16,
    )
    assert len(list(steps)) == 10
    for c in caches:
        assert type(c).__name__ == "MorphKVCache" and c.bits == bits and c.group_size == 64
        assert isinstance(c.keys, tuple) and c.tokens_kept == 20 and c.offset >= 49
    assert caches[0].to_quantized(group_size=64, bits=bits) is caches[0]
    with pytest.raises(ValueError, match="already stores"):
        caches[0].to_quantized(group_size=64, bits=12 - bits)


def test_mlx_lm_cache_to_quantized_logic(model):
    """mlx_lm's test_cache_to_quantized: generate 2 tokens, convert with to_quantized(bits=8,
    group_size=32), the next token and its logits match the unconverted run (rtol 4e-2)."""
    config = KVCacheConfig(method="morphkv", **dict(CONFIG, morphkv_budget=200))
    prompt = PROMPT[0, :20]
    ref_steps = generate_step(prompt, model, prompt_cache=KVCacheBuilder.for_model(model, config))
    ref = [next(ref_steps) for _ in range(4)]
    caches = KVCacheBuilder.for_model(model, config)
    steps = generate_step(prompt, model, prompt_cache=caches)
    assert [next(steps)[0] for _ in range(2)] == [ref[0][0], ref[1][0]]
    caches = [c.to_quantized(bits=8, group_size=32) for c in caches]
    # generate_step runs one step ahead: the caches have seen the prompt and 2 tokens
    tok, logits = next(generate_step(mx.array([ref[2][0]]), model, prompt_cache=caches))
    assert tok == ref[3][0]
    assert mx.allclose(logits, ref[3][1], rtol=4e-2)


def test_dequantized_storage_is_close_to_float():
    """mlx_lm's test_rotating_to_quantized_dequantize_close_to_float, on to_quantized."""
    k, v = random_kv(T=10, dtype=mx.float32)
    cache = KVCacheBuilder.build(KVCacheConfig(scoring="proxy", **CONFIG))
    cache.update_and_fetch(k, v)
    q = cache.to_quantized(group_size=32, bits=8)
    assert not hasattr(cache, "bits") and q.bits == 8
    for stored, want in zip(q._fetch(), (k, v), strict=True):
        got = mx.dequantize(*stored, group_size=q.group_size, bits=q.bits)
        assert mx.allclose(got, want, rtol=1e-2, atol=2e-2)


# ---- bytes, bad input ----------------------------------------------------------------------
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_bytes_are_real(bits):
    k, v = random_kv(dtype=mx.float16)
    cache = KVCacheBuilder.build(KVCacheConfig(kv_bits=bits, scoring="proxy", **CONFIG))
    cache.update_and_fetch(k[:, :, :40], v[:, :, :40])
    for t in range(40, 60):
        cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    row = 64 * 2 if bits is None else 64 * bits // 8 + 2 * 2  # + scale and bias, float16
    assert cache.morphkv_kept_bytes == 20 * 2 * row
    assert cache.full_seq_bytes == 60 * 2 * 64 * 2
    assert cache.compression_ratio == pytest.approx(60 * 64 * 2 / (20 * row))
    stored = [cache.keys] if bits is None else list(cache.keys)
    assert cache.storage_nbytes == 2 * sum(a.nbytes for a in stored) == 2 * 2 * 21 * row


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_bits=3), "kv_bits must be None or one of"),
        (dict(kv_bits=True), "kv_bits must be None or one of"),
        (dict(kv_bits=8.0), "kv_bits must be None or one of"),
        (dict(kv_bits=8, kv_group_size=48), "kv_group_size must be one of"),
        (dict(kv_bits=8, head_dim=16), "must divide head_dim=16"),
    ],
)
def test_bad_storage_config_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCacheBuilder.build(KVCacheConfig(**kwargs))


def test_head_dim_not_divisible_is_rejected_unchanged():
    cache = KVCacheBuilder.build(KVCacheConfig(kv_bits=8, scoring="proxy", **CONFIG))
    k = mx.zeros((1, 2, 5, 16))
    with pytest.raises(ValueError, match="kv_group_size=64 must divide"):
        cache.update_and_fetch(k, k)
    assert cache.empty() and cache.offset == 0
    plain = KVCacheBuilder.build(KVCacheConfig(scoring="proxy", **CONFIG))
    plain.update_and_fetch(k, k)
    with pytest.raises(ValueError, match="must divide the head dims"):
        plain.to_quantized(group_size=64, bits=8)


# ---- eviction decisions barely change with storage precision (embedded model) ---------------
def kept_sets(model, tokens, config):
    caches = KVCacheBuilder.for_model(model, config)
    for s in range(0, tokens.shape[1], 128):
        mx.eval(model(tokens[:, s : s + 128], cache=caches))
    return [c.kept_positions[0] for c in caches]


def test_kept_sets_at_8_bits_overlap_the_float_cache():
    """The same 400-token prose stream through SmolLM2 with float and 8-bit storage (the
    recommended morphkv setting, budget 64): per layer and KV head, >= 95% of the kept tokens
    are the same on average. Keys differ by quantization and, in later layers, by the drift
    quantized attention causes upstream; the scores use the keys as stored."""
    from smollm2_fixture import load_embedded

    from morphkv.eval import texts

    model, tok = load_embedded()
    tokens = mx.array(texts.prose_documents(tok, 400, 1)[0])[None]
    setting = dict(method="morphkv", morphkv_budget=64, morphkv_recent=32, morphkv_value=True)
    ref = kept_sets(model, tokens, KVCacheConfig(**setting))
    got = kept_sets(model, tokens, KVCacheConfig(kv_bits=8, **setting))
    overlaps = [
        np.intersect1d(a[h], b[h]).size / a.shape[1]
        for a, b in zip(ref, got, strict=True)
        for h in range(a.shape[0])
    ]
    assert ref[0].shape[1] == 64 and len(overlaps) == 30 * 3
    assert np.mean(overlaps) >= 0.95, np.mean(overlaps)
    assert min(overlaps) < 1.0  # the quantized run did decide on its own keys


@pytest.mark.parametrize("bits", [8, 4])
def test_bound_known_early_equals_bytes_once_full(bits):
    k = mx.random.normal((1, 2, 100, 64)).astype(mx.float16)
    cache = KVCacheBuilder.build(KVCacheConfig(morphkv_budget=32, kv_bits=bits))
    cache.update_and_fetch(k[:, :, :5], k[:, :, :5])
    bound = cache.nbytes_bound
    cache.update_and_fetch(k[:, :, 5:], k[:, :, 5:])
    assert bound == cache.nbytes


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_scales_are_two_bytes_and_attention_computes_in_float32(model, dtype):
    """Scales and biases are stored in float16 for float32 keys (4 bytes a group of 64, not 8:
    a 64-dim row is 68 bytes at 8 bits) and in the arriving dtype otherwise; the stored rows
    dequantize to the keys within an 8-bit step, and a chunk's attention (dequantized in
    float32) equals token-by-token decoding (mlx's quantized matmul) on a float32 model."""
    k, v = random_kv(T=10, dtype=dtype)
    cache = KVCacheBuilder.build(KVCacheConfig(kv_bits=8, kv_group_size=64, scoring="proxy",
                                                **CONFIG))
    keys, _ = cache.update_and_fetch(k, v)
    want = mx.float16 if dtype == mx.float32 else dtype
    assert keys[1].dtype == keys[2].dtype == want
    assert cache.morphkv_kept_bytes == 10 * 2 * (64 + 2 * 2)
    got, k = quant.dequantize(keys, 64, 8, mx.float32), k.astype(mx.float32)
    step = (k.max(-1, keepdims=True) - k.min(-1, keepdims=True)) / 255  # one 8-bit step
    slack = 2 ** -8 if dtype == mx.bfloat16 else 2 ** -11  # the scales' own rounding
    assert bool(mx.all(mx.abs(got - k) <= step * (1 + 255 * slack) + 2 * slack * mx.abs(k)))
    if dtype == mx.float32:
        config = KVCacheConfig(method="full", kv_bits=8, **CONFIG)
        a, _ = run(model, config, 1)
        b, _ = run(model, config, 70)
        np.testing.assert_allclose(a, b, atol=2e-3)
