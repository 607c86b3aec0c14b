"""Key smoothing (``morphkv.mlxlm.keyscale``, ``kv_smooth``): on a tiny random Qwen2 whose key
bias has outlier channels, the folded scales leave the logits unchanged, share one scale per
rotary pair, are applied once however often the model is patched, come off again with
``unpatch_model``, and make 8-bit keys round closer to the float cache than without them."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from morphkv import KVCacheBuilder, KVCacheConfig, patch_model, recommended, unpatch_model
from morphkv.core import quant
from morphkv.mlxlm import keyscale
from morphkv.runtime.cache_flags import describe
from tests.test_families import tiny as family_model

OUTLIERS = (29, 30, 61, 62)  # two rotary pairs of a 64-dim head: (29, 61), (30, 62)
PROMPT = mx.array([[int(i) for i in np.random.default_rng(0).integers(0, 128, 80)]])
EIGHT_BITS = KVCacheConfig(method="streaming_llm", morphkv_budget=512, kv_bits=8,
                           kv_group_size=32)


def tiny(family: str = "qwen2"):
    """test_families' tiny model with 64-dim heads; Qwen2's key bias gets two outlier pairs."""
    model = family_model(family, hidden_size=256, **({"head_dim": 64} if family == "qwen3" else {}))
    for layer in model.layers:
        k = getattr(layer.self_attn.k_proj, "bias", None)
        if k is not None:  # Qwen's large key-bias entries
            planted = np.array(k).reshape(2, 64)
            planted[:, list(OUTLIERS)] = 12.0
            layer.self_attn.k_proj.bias = mx.array(planted.reshape(-1))
    mx.eval(model.parameters())
    return model


def logits(model, caches=None) -> np.ndarray:
    caches = make_prompt_cache(model) if caches is None else caches
    return np.array(model(PROMPT, cache=caches).astype(mx.float32))


def weights(model) -> list[np.ndarray]:
    return [np.array(p) for layer in model.layers for m in (layer.self_attn.q_proj,
            layer.self_attn.k_proj) for p in m.parameters().values()]


def test_scales_leave_logits_and_come_off_exactly():
    model = tiny()
    before, plain = logits(model), weights(model)
    assert keyscale.smooth(model) == 2
    assert keyscale.smooth(model) == 2  # once: a second call does not scale again
    np.testing.assert_allclose(logits(model), before, atol=1e-4)
    assert not all(np.array_equal(a, b) for a, b in zip(weights(model), plain, strict=True))
    keyscale.restore(model)
    assert all(np.array_equal(a, b) for a, b in zip(weights(model), plain, strict=True))


def test_one_scale_per_rotary_pair_and_the_outliers_are_divided_out():
    bias = mx.array(np.where(np.isin(np.arange(32), [3, 29]), 10.0, 1.0)[None].repeat(2, 0))
    for traditional, partner in ((False, lambda c: (c + 16) % 32), (True, lambda c: c ^ 1)):
        s = np.array(keyscale.pair_scale(bias.reshape(-1), 2, 32, traditional))  # head dim 32
        assert all(s[h, c] == s[h, partner(c)] for h in range(2) for c in range(32))
        assert np.isclose(s[0, 3], 10.0 ** keyscale.ALPHA) and s[0, 3] == s[0, 29] and s.min() == 1
    s = np.array(keyscale.pair_scale(bias.reshape(-1), 2, 16, False))  # partial rotary
    assert s[0, 29] == s[0, 3] and s[0, 13] == 1.0  # channel 29 is past the rotary dims: its own


def test_patch_model_smooths_a_quantizing_config_once_and_unpatch_restores():
    model = tiny()
    plain = weights(model)
    patch_model(model, recommended(memory=64 * 1024))
    patch_model(model, recommended(memory=64 * 1024))
    smoothed = weights(model)
    patch_model(model, recommended(256))  # a float config leaves the model as it is
    assert all(np.array_equal(a, b) for a, b in zip(weights(model), smoothed, strict=True))
    patch_model(model, recommended(memory=64 * 1024, kv_smooth=False))  # off: restored
    assert all(np.array_equal(a, b) for a, b in zip(weights(model), plain, strict=True))
    patch_model(model, recommended(memory=64 * 1024))
    unpatch_model(model)
    assert all(np.array_equal(a, b) for a, b in zip(weights(model), plain, strict=True))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_models_without_a_plain_key_bias_are_untouched(family):
    model = tiny(family)
    plain = weights(model)
    KVCacheBuilder.for_model(model, EIGHT_BITS)
    assert all(np.array_equal(a, b) for a, b in zip(weights(model), plain, strict=True))


def first_keys(model) -> mx.array:
    cache = make_prompt_cache(model)
    model(PROMPT, cache=cache)
    return cache[0].keys[..., : PROMPT.shape[1], :].astype(mx.float32)


def test_eight_bit_keys_round_closer_with_the_outliers_divided_out():
    """The first layer's keys rounded as stored (8 bits, groups of 64), read back in the
    model's own coordinates: closer to the exact keys once the outlier pairs are divided out."""
    model = tiny()
    keys = first_keys(model)
    keyscale.smooth(model)
    s = keyscale.applied(model)[0][None, :, None, :]
    smoothed = first_keys(model)
    np.testing.assert_allclose(np.array(smoothed * s), np.array(keys), rtol=1e-4, atol=1e-4)

    def error(x, back=1.0):
        got = quant.dequantize(quant.quantize(x, 64, 8), 64, 8, mx.float32) * back
        return float(mx.sqrt(mx.mean((got - keys) ** 2)))

    plain, divided = error(keys), error(smoothed, s)
    assert divided < 0.8 * plain, (divided, plain)


def test_a_cache_saved_before_smoothing_existed_reads_back_unsmoothed(tmp_path):
    """Keys saved without the field were stored unsmoothed: the loaded config says so, so a
    check against the running (smoothing) config sees the difference instead of mixing them."""
    assert KVCacheConfig.from_json(EIGHT_BITS.to_json()).kv_smooth is True
    old = json.loads(EIGHT_BITS.to_json())
    del old["kv_smooth"]
    assert KVCacheConfig.from_json(json.dumps(old)).kv_smooth is False
    old["kv_bits"] = None  # a float cache: the field changes nothing, the default stays
    assert KVCacheConfig.from_json(json.dumps(old)).kv_smooth is True
    model = tiny()
    caches = KVCacheBuilder.for_model(model, EIGHT_BITS)
    model(PROMPT, cache=caches)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches)
    arrays, meta = mx.load(path, return_metadata=True)
    for i in range(len(caches)):  # rewrite each config as a release before kv_smooth wrote it
        name = f"{i}.0"  # mlx_lm stores the state's strings as arrays of code points
        fields = json.loads("".join(chr(c) for c in arrays[name].tolist()))
        del fields["kv_smooth"]
        arrays[name] = mx.array([ord(c) for c in json.dumps(fields)])
    mx.save_safetensors(path, arrays, metadata=meta)
    loaded = load_prompt_cache(path)
    assert loaded[0].config.kv_smooth is False
    # what chat --load's refusal names
    assert "--no-kv-smooth" in describe(loaded[0].config) and "smooth" not in describe(EIGHT_BITS)
    keyscale.restore(model)
