"""attach(): real-query scoring and exact per-token semantics inside prefill chunks."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import llama
from reference import reference_kept

import morphkv
from morphkv import METHODS, KVCacheBuilder, KVCacheConfig
from morphkv.bench._util import tiny_llama

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


def test_other_caches_fall_through_and_detach_restores():
    model = morphkv.detach(tiny_llama(seed=2))
    original = llama.scaled_dot_product_attention

    def logits():
        out = [model(PROMPT[:, :40], cache=(c := mlx_cache.make_prompt_cache(model)))]
        out.append(model(PROMPT[:, 40:41], cache=c))
        out.append(model(PROMPT[:, :30]))  # no cache at all
        return [np.array(x) for x in out]

    before = logits()
    morphkv.attach(model)
    assert llama.scaled_dot_product_attention is not original
    during = logits()
    morphkv.detach(model)
    assert llama.scaled_dot_product_attention is original
    after = logits()
    for x, y, z in zip(before, during, after, strict=True):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, z)


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
