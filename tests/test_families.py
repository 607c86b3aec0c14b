"""Every mlx_lm family with standard attention, as a tiny random-weight model: generation runs,
the hook is attached where the family allows it, chunked prefill equals token by token there,
sliding / linear-attention layers keep mlx_lm's caches, and kept sets and bytes add up per layer.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache
from mlx_lm.utils import _get_classes

from morphkv import KVCacheBuilder, KVCacheConfig, MorphKVCache
from morphkv.eval.models import greedy_tokens
from morphkv.mlxlm.hooks import is_installed
from morphkv.mlxlm.layout import describe_layout, morph_caches

BUDGET = 12
CONFIG = KVCacheConfig(morphkv_budget=BUDGET, morphkv_n_sink=2, morphkv_window=3)
PROMPT = [(5 * i + 3) % 120 + 1 for i in range(30)]
BASE = dict(
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=128,
)
QWEN3 = dict(head_dim=8, max_position_embeddings=512, tie_word_embeddings=False, rope_theta=1e4)

FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": QWEN3,
    "phi3": {},
    "gemma": dict(head_dim=8),
    "gemma2": dict(head_dim=8, query_pre_attn_scalar=10.0),
    # Gemma 3's real layout: sliding layers (window 6) then a global one, queries scaled by
    # query_pre_attn_scalar (not head_dim)
    "gemma3_text": dict(
        head_dim=8,
        num_hidden_layers=3,
        sliding_window=6,
        sliding_window_pattern=3,
        query_pre_attn_scalar=3.0,
    ),
    "smollm3": {},  # its model class reuses llama's attention: the llama module is hooked
    "starcoder2": {},
    "olmo2": {},
    "cohere": {},
    "gpt_oss": dict(
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "qwen3_next": dict(  # hybrid: linear-attention layers (ArraysCache) + full attention
        head_dim=8,
        num_hidden_layers=4,
        full_attention_interval=2,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=32,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rope_theta=1e4,
        partial_rotary_factor=0.5,
        max_position_embeddings=512,
    ),
    "falcon_h1": dict(  # each layer: a Mamba-2 mixer and attention side by side (CacheList)
        head_dim=8,
        mamba_d_ssm=32,
        mamba_d_state=8,
        mamba_d_head=8,
        mamba_n_heads=4,
        mamba_chunk_size=8,
        mlp_expansion_factor=2,
    ),
}
NOT_HOOKED = {"gemma2"}  # computes attention itself (soft-capping): proxy scoring, warned


def tiny(family: str, seed: int = 0, **overrides):
    config = dict(BASE, model_type=family, **{**FAMILIES[family], **overrides})
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


def build(model, config=CONFIG):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        caches = KVCacheBuilder.for_model(model, config)
    return caches, [str(w.message) for w in caught]


def feed(model, caches, step):
    prompt = mx.array([PROMPT])
    outs = [model(prompt[:, i : i + step], cache=caches) for i in range(0, len(PROMPT), step)]
    return np.array(mx.concatenate(outs, axis=1).astype(mx.float32))


def kv_shape(family):
    """(KV heads, head_dim) of the full-attention layers."""
    args = dict(BASE, **FAMILIES[family])
    return args["num_key_value_heads"], args.get("head_dim", BASE["hidden_size"] // 4)


def _kinds(cache) -> str:
    inner = cache.caches if isinstance(cache, CacheList) else (cache,)
    return repr([type(c).__name__ for c in inner])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_generates_with_its_own_layout(family):
    model = tiny(family)
    native = model.make_cache() if hasattr(model, "make_cache") else [KVCache()] * len(model.layers)
    caches, warned = build(model)
    assert len(caches) == len(native)
    for mine, theirs in zip(caches, native, strict=True):  # only full attention is replaced
        assert _kinds(mine) == _kinds(theirs).replace("'KVCache'", "'MorphKVCache'")
    assert is_installed(model) == (family not in NOT_HOOKED)
    scoring = "proxy" if family in NOT_HOOKED else "attention"  # what "auto" became
    assert {c.config.scoring for c in morph_caches(caches)} == {scoring}
    assert bool(warned) == (family in NOT_HOOKED)
    tokens = greedy_tokens(model, caches, PROMPT, max_tokens=4, prefill_step_size=8)
    assert len(tokens) == 4
    seen = morph_caches(caches)[0].tokens_seen
    assert seen >= len(PROMPT) + 3  # (mlx_lm may compute one step ahead)
    heads, head_dim = kv_shape(family)
    morph = morph_caches(caches)
    assert morph and len(morph) == sum(_kinds(c).count("'KVCache'") for c in native)
    for cache in morph:  # per layer: exactly the budget kept, bytes add up
        assert cache.tokens_seen == seen and cache.tokens_kept == BUDGET
        assert cache.kept_positions.shape == (1, heads, BUDGET)
        assert cache.morphkv_kept_bytes == BUDGET * 2 * head_dim * 4  # K+V float32
        assert cache.full_seq_bytes == seen * 2 * head_dim * 4
        assert cache.storage_nbytes == (BUDGET + 1) * heads * 2 * head_dim * 4
        assert cache.nbytes == cache.storage_nbytes + cache.engine_nbytes
    layout = describe_layout(caches)
    if not any(isinstance(c, CacheList) for c in caches):
        assert f"{len(morph)} x MorphKVCache, morphkv budget {BUDGET}" in layout
    if any(isinstance(c, RotatingKVCache) for c in caches):
        assert "RotatingKVCache, window 6" in layout
    if any(isinstance(c, ArraysCache) for c in caches):
        assert "ArraysCache, fixed-size state" in layout
    if any(isinstance(c, CacheList) for c in caches):
        kind = "CacheList(ArraysCache, MorphKVCache)"
        assert f"{kind}, fixed-size state + morphkv budget {BUDGET}" in layout


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - NOT_HOOKED))
@pytest.mark.parametrize("scoring", ["attention", "proxy"])
def test_chunked_prefill_equals_token_by_token(family, scoring):
    model = tiny(family, seed=1)
    config = replace(CONFIG, scoring=scoring)
    want_caches, _ = build(model, config)
    want = feed(model, want_caches, 1)
    for step in (7, 30):
        caches, _ = build(model, config)
        got = feed(model, caches, step)
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-3, err_msg=f"chunks of {step}")
        for a, b in zip(morph_caches(caches), morph_caches(want_caches), strict=True):
            np.testing.assert_array_equal(a.kept_positions, b.kept_positions)


def test_unhooked_family_warns_once_and_refuses_attention_scoring():
    model = tiny("gemma2")
    caches, warned = build(model)
    assert warned and "proxy" in warned[0] and "not exact" in warned[0]
    want = feed(model, build(model)[0], 1)  # no second warning for this model
    assert not build(model)[1]
    got = feed(model, caches, 30)  # what the warning says: a chunk sees evicted tokens
    assert np.abs(got[:, -1] - want[:, -1]).max() > 1e-3
    assert build(tiny("gemma2"))[1]  # another model: warned again
    with pytest.raises(ValueError, match="mlx_lm.models.gemma2"):
        KVCacheBuilder.for_model(model, replace(CONFIG, scoring="attention"))


class _Recorder(KVCache):
    """mlx_lm's KVCache that also records what the attention hook hands a morphkv cache."""

    def prepare_attention(self, queries, scale, mask):
        self.queries, self.scale = queries, scale
        return mask


SCALAR = 0.05  # logit scale 4.5 where head_dim would give 0.35


@pytest.mark.parametrize("method", ["morphkv", "h2o"])
def test_gemma3_scores_with_the_models_scale(method):
    """Gemma 3 scales queries by query_pre_attn_scalar**-0.5, not head_dim**-0.5: the kept
    sets equal a token-by-token reference with the model's scale (and not with head_dim's)."""
    from reference import reference_kept

    model = tiny("gemma3_text", seed=3, query_pre_attn_scalar=SCALAR)
    config = replace(CONFIG, method=method, scoring="attention")
    caches, _ = build(model, config)
    feed(model, caches, 7)
    layer = next(i for i, c in enumerate(caches) if isinstance(c, MorphKVCache))
    recorded = model.make_cache()
    recorded[layer] = recorder = _Recorder()
    keys, queries = [], []
    for t in range(len(PROMPT)):  # the model's own keys and queries, one token at a time
        model(mx.array([PROMPT[t : t + 1]]), cache=recorded)
        keys.append(np.array(recorder.keys[0, :, t]))
        queries.append(np.array(recorder.queries[0, :, 0]))
    keys, queries = np.stack(keys, 1), np.stack(queries, 1)  # (H, T, D), (H*G, T, D)
    H, T, D = keys.shape
    assert recorder.scale == pytest.approx(SCALAR**-0.5)
    kept, default = caches[layer].kept_positions[0], []
    for h in range(H):
        q = queries.reshape(H, -1, T, D)[h].transpose(1, 0, 2)  # (T, G, D)
        args = (keys[h], method, BUDGET, 2, 3)
        # the reference scores with D**-0.5: queries rescaled to the model's scale
        assert kept[h].tolist() == reference_kept(*args, queries=q * recorder.scale * D**0.5)
        default.append(reference_kept(*args, queries=q))
    assert default != kept.tolist()  # the scale matters here


def test_patch_model_builds_on_the_models_own_factory():
    """patch_model over a model with its own make_cache (twice: no recursion), then undone."""
    from mlx_lm.models.cache import make_prompt_cache

    from morphkv import patch_model, unpatch_model

    model = tiny("gemma3_text")
    kinds = [type(c) for c in make_prompt_cache(model)]
    patch_model(model, CONFIG)
    patch_model(model, CONFIG)
    caches = make_prompt_cache(model)
    assert [type(c) for c in caches] == [RotatingKVCache, RotatingKVCache, MorphKVCache]
    assert caches[2] is not make_prompt_cache(model)[2]
    assert len(greedy_tokens(model, caches, PROMPT, max_tokens=3, prefill_step_size=8)) == 3
    unpatch_model(model)
    assert [type(c) for c in make_prompt_cache(model)] == kinds


def test_model_without_full_attention_is_refused():
    model = tiny("gemma3_text", num_hidden_layers=2)  # pattern 3: both layers sliding
    with pytest.raises(ValueError, match="no full-attention KVCache layer"):
        KVCacheBuilder.for_model(model, CONFIG)
    assert not is_installed(model)
