"""Decode steps on the device (MLX arrays, no host sync), as used on GPUs; run here on the CPU.

The device engine works in float32 instead of the host's float64; on these streams both make
the same decisions, and switching between them (prefill on the host, decode on the device,
another chunk on the host) loses nothing."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from morphkv import KVCacheBuilder, KVCacheConfig, MorphKVCache
from morphkv.eval.util import greedy_tokens, tiny_llama

CONFIG = dict(morphkv_budget=24, morphkv_n_sink=2, morphkv_window=4)


def generate(model, config, prompt, on_device, monkeypatch):
    monkeypatch.setattr(MorphKVCache, "decode_on_device", on_device)
    caches = KVCacheBuilder.for_model(model, config)
    return greedy_tokens(model, caches, prompt, max_tokens=30, prefill_step_size=16), caches


@pytest.mark.parametrize("scoring", ["proxy", "attention"])
@pytest.mark.parametrize("method", ["morphkv", "h2o", "tova", "streaming_llm", "random"])
def test_device_decode_matches_host_decode(method, scoring, monkeypatch):
    model = tiny_llama(seed=3)
    config = KVCacheConfig(method=method, scoring=scoring, **CONFIG)
    prompt = [(5 * i + 1) % 250 + 1 for i in range(40)]
    host_tokens, host = generate(model, config, prompt, False, monkeypatch)
    device_tokens, device = generate(model, config, prompt, True, monkeypatch)
    assert all(c.engine.on_device for c in device)  # decode left the state on the device
    assert device_tokens == host_tokens
    for a, b in zip(device, host, strict=True):
        np.testing.assert_array_equal(a.kept_positions, b.kept_positions)


def test_device_steps_keep_state_in_mlx_and_chunks_return_to_the_host(monkeypatch):
    monkeypatch.setattr(MorphKVCache, "decode_on_device", True)
    rng = np.random.default_rng(0)
    keys = mx.array(rng.standard_normal((1, 2, 80, 8)).astype(np.float32))
    config = KVCacheConfig(method="morphkv", **CONFIG)
    cache, reference = KVCacheBuilder.build(config), KVCacheBuilder.build(config)
    reference.update_and_fetch(keys, keys)
    cache.update_and_fetch(keys[:, :, :30], keys[:, :, :30])
    for t in range(30, 60):
        cache.update_and_fetch(keys[:, :, t : t + 1], keys[:, :, t : t + 1])
        engine = cache.engine
        assert engine.on_device
        assert isinstance(engine.dead, mx.array)
        assert isinstance(engine.attention.ring_weights, mx.array)
    cache.update_and_fetch(keys[:, :, 60:], keys[:, :, 60:])  # a new chunk: back on the host
    assert not cache.engine.on_device
    np.testing.assert_array_equal(cache.kept_positions, reference.kept_positions)
