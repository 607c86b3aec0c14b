"""attach(): real-query scoring and exact per-token semantics inside prefill chunks."""

from __future__ import annotations

import gc

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import base, llama
from mlx_lm.models import cache as mlx_cache
from reference import reference_kept

import morphkv
from morphkv import METHODS, KVCacheBuilder, KVCacheConfig
from morphkv.eval.models import tiny_llama
from morphkv.mlxlm import hooks

CONFIG = dict(morphkv_budget=20, morphkv_n_sink=2, morphkv_window=4)
PROMPT = mx.array([[(7 * i + 3) % 251 + 1 for i in range(70)]])


@pytest.fixture
def model():
    model = tiny_llama(seed=1)
    yield morphkv.attach(model)
    morphkv.detach(model)


def run(model, config, step):
    """Logits for every prompt position, fed in chunks of ``step`` tokens."""
    caches = KVCacheBuilder.for_model(model, config)
    outs = [model(PROMPT[:, i : i + step], cache=caches) for i in range(0, PROMPT.shape[1], step)]
    return np.array(mx.concatenate(outs, axis=1)), caches


@pytest.mark.parametrize("scoring", ["proxy", "attention"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_any_prefill_chunking_equals_token_by_token(model, method, scoring):
    config = KVCacheConfig(method=method, scoring=scoring, **CONFIG)
    want, want_caches = run(model, config, 1)
    for step in (5, 16, 70):
        got, caches = run(model, config, step)
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4, err_msg=f"chunks of {step}")
        for a, b in zip(caches, want_caches, strict=True):
            np.testing.assert_array_equal(a.kept_positions, b.kept_positions)


def test_without_attach_chunks_see_tokens_evicted_inside_the_chunk():
    """The reason attach exists: without it a chunk's queries see [kept + whole chunk]."""
    gc.collect()  # attached models of earlier tests, unreachable but in cycles, keep llama hooked
    assert "mlx_lm.models.llama" not in hooks._MODELS, "a live attached llama model remains"
    plain = morphkv.detach(tiny_llama(seed=1))
    config = KVCacheConfig(method="morphkv", scoring="proxy", **CONFIG)
    caches = [KVCacheBuilder.build(config) for _ in plain.layers]
    chunked = np.array(plain(PROMPT, cache=caches))
    exact, _ = run(morphkv.attach(plain), config, 70)
    morphkv.detach(plain)
    assert np.abs(chunked[:, -1] - exact[:, -1]).max() > 1e-3


@pytest.mark.parametrize(
    "method, fusion", [("morphkv", "mean"), ("morphkv", "max"), ("tova", "mean"), ("h2o", "mean")]
)
def test_attention_scores_match_numpy_reference_from_real_queries(model, method, fusion):
    rng = np.random.default_rng(5)
    B, H, G, T, D = 2, 2, 3, 60, 8
    keys = rng.standard_normal((B, H, T, D)).astype(np.float32)
    queries = rng.standard_normal((B, H, G, T, D)).astype(np.float32)
    config = KVCacheConfig(method=method, scoring="attention", morphkv_fusion=fusion, **CONFIG)
    cache = KVCacheBuilder.build(config)
    for t in range(T):
        k = mx.array(keys[:, :, t : t + 1])
        cache.update_and_fetch(k, k)
        q = mx.array(queries[:, :, :, t : t + 1].reshape(B, H * G, 1, D))
        cache.prepare_attention(q, D**-0.5, None)
    for b in range(B):
        for h in range(H):
            want = reference_kept(
                keys[b, h], method, 20, 2, 4, fusion, queries=queries[b, h].transpose(1, 0, 2)
            )
            assert cache.kept_positions[b, h].tolist() == want


def test_for_model_attaches_and_auto_means_real_queries():
    model = morphkv.detach(tiny_llama(seed=1))
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(**CONFIG))
    assert caches[0].config.scoring == "attention"
    assert llama.scaled_dot_product_attention.morphkv_original is not None
    assert KVCacheBuilder.build(KVCacheConfig(**CONFIG)).config.scoring == "proxy"


def test_attention_scoring_differs_from_proxy(model):
    proxy = run(model, KVCacheConfig(method="morphkv", scoring="proxy", **CONFIG), 16)[1]
    real = run(model, KVCacheConfig(method="morphkv", scoring="attention", **CONFIG), 16)[1]
    assert any(
        not np.array_equal(a.kept_positions, b.kept_positions)
        for a, b in zip(proxy, real, strict=True)
    )


def test_attention_scoring_requires_attach():
    plain = morphkv.detach(tiny_llama(seed=1))
    config = KVCacheConfig(scoring="attention", **CONFIG)
    caches = [KVCacheBuilder.build(config) for _ in plain.layers]
    with pytest.raises(RuntimeError, match="morphkv.attach"):
        plain(PROMPT[:, :4], cache=caches)


def _llama_hook_users() -> int:
    gc.collect()  # models that died in earlier tests release the module
    return len(hooks._MODELS.get(llama.__name__, {}))


def test_other_caches_fall_through_and_detach_restores():
    model = morphkv.detach(tiny_llama(seed=2))

    def logits():
        out = [model(PROMPT[:, :40], cache=(c := mlx_cache.make_prompt_cache(model)))]
        out.append(model(PROMPT[:, 40:41], cache=c))
        out.append(model(PROMPT[:, :30]))  # no cache at all
        return [np.array(x) for x in out]

    before = logits()
    morphkv.attach(model)
    assert hooks.is_installed(model)
    assert hasattr(llama.scaled_dot_product_attention, "morphkv_original")
    during = logits()
    morphkv.detach(model)
    assert not hooks.is_installed(model)
    if _llama_hook_users() == 0:  # no other attached llama model alive in this process
        assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
    after = logits()
    for x, y, z in zip(before, during, after, strict=True):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, z)


def test_detach_affects_only_the_model_given():
    """Two models of one family: detaching A leaves B hooked (exact chunks, real queries)."""
    a, b = tiny_llama(seed=1), tiny_llama(seed=2)
    config = KVCacheConfig(method="morphkv", scoring="attention", **CONFIG)
    KVCacheBuilder.for_model(a, config)
    want, want_caches = run(b, config, 1)
    morphkv.detach(a)
    assert not hooks.is_installed(a) and hooks.is_installed(b)
    got, caches = run(b, config, 16)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    for x, y in zip(caches, want_caches, strict=True):
        np.testing.assert_array_equal(x.kept_positions, y.kept_positions)
    users = _llama_hook_users()
    morphkv.detach(b)
    assert _llama_hook_users() == users - 1


def test_a_dropped_model_releases_the_module():
    users = _llama_hook_users()
    model = morphkv.attach(tiny_llama(seed=3))
    assert _llama_hook_users() == users + 1
    del model
    assert _llama_hook_users() == users
    if users == 0:
        assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_unsupported_model_names_its_module():
    class Plain(nn.Module):
        pass

    with pytest.raises(ValueError, match=__name__):
        morphkv.attach(Plain())


def test_attach_with_config_installs_the_factory(model):
    morphkv.attach(model, KVCacheConfig(method="h2o", scoring="attention", **CONFIG))
    caches = mlx_cache.make_prompt_cache(model)
    model(PROMPT, cache=caches)
    assert caches[0].config.method == "h2o" and caches[0].tokens_kept == 20
