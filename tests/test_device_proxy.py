"""Keys as proxy queries on the MLX engine (``core.device_proxy``: one compiled step per decode
token; ``core.proxy_schedule``: a chunk's evictions replayed on the host): the kept sets are
the float64 reference's (outside near-ties), for every window fusion, chunked or token by
token, through the seed's API (``update_and_fetch`` alone) and through the attention hook; the
paths really run, and the state they keep is counted in the cache's bytes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.core import device_proxy, proxy_schedule
from morphkv.core.device import RTOL
from morphkv.mlxlm.hooks import attention_step, queries_by_hand
from tests.reference import reference_kept

SCALE = 0.25


def _stream(T: int, H: int = 2, D: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    keys = (2 * rng.standard_normal((1, H, T, D))).astype(np.float16)
    values = rng.standard_normal((1, H, T, D)).astype(np.float16)
    queries = rng.standard_normal((1, 2 * H, T, D)).astype(np.float16)
    return keys, values, queries


def _feed(config, keys, values, queries, cuts, hooked: bool):
    cache = KVCacheBuilder.build(config)
    start = 0
    for end in [*cuts, keys.shape[2]]:
        if end > start:
            k, v, q = (mx.array(x[:, :, start:end]) for x in (keys, values, queries))
            if hooked:
                mx.eval(attention_step(cache, q, k, v, SCALE))
            else:
                mx.eval(cache.update_and_fetch(k, v))
            start = end
    return cache


def _check(cache, config, keys) -> int:
    """Heads compared with the reference (near-ties skipped); returns how many."""
    compared = 0
    scale = SCALE if cache.engine.scale == SCALE else 1 / np.sqrt(keys.shape[-1])
    for h in range(keys.shape[1]):
        margins: list = []
        want = reference_kept(keys[0, h].astype(np.float64), config.method, config.budget,
                              config.morphkv_n_sink, config.window, fusion=config.morphkv_fusion,
                              recent=config.recent, scale=scale, margins=margins)
        if min(margins, default=1.0) > RTOL:
            assert cache.kept_positions[0, h].tolist() == want, (config, h)
            compared += 1
    return compared


@pytest.mark.parametrize("method,fusion,window", [("morphkv", "mean", 4), ("morphkv", "max", 4),
                                                  ("tova", "mean", 1), ("morphkv", "mean", 8)])
@pytest.mark.parametrize("hooked", [False, True])
def test_proxy_paths_keep_what_the_reference_keeps(method, fusion, window, hooked):
    keys, values, queries = _stream(150)
    compared = 0
    for cuts in ([150], [40, *range(41, 150)], [30, 70, 71, 72, 120]):
        config = KVCacheConfig(method=method, morphkv_budget=32, morphkv_window=window,
                               morphkv_fusion=fusion, scoring="proxy", engine="mlx")
        with queries_by_hand():
            cache = _feed(config, keys, values, queries, cuts, hooked)
        compared += _check(cache, config, keys)
    assert compared >= 2  # heads with a near-tie anywhere are skipped: some are compared


def test_decode_tokens_take_the_compiled_step_and_chunks_the_replay(monkeypatch):
    """Both fast paths run (counted), decode stays exact across a read that evicts early
    (``tokens_kept`` between tokens), and the step's state is in the cache's bytes."""
    calls = {"step": 0, "schedule": 0}
    step, schedule = device_proxy.step, proxy_schedule.schedule

    def counted(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(device_proxy, "step", counted("step", step))
    monkeypatch.setattr(proxy_schedule, "schedule", counted("schedule", schedule))
    keys, values, queries = _stream(160, seed=3)
    config = KVCacheConfig(method="morphkv", morphkv_budget=48, morphkv_window=4,
                           engine="mlx")
    cache = KVCacheBuilder.build(config)
    held = None
    mx.eval(cache.update_and_fetch(mx.array(keys[:, :, :100]), mx.array(values[:, :, :100])))
    for t in range(100, 160):
        mx.eval(cache.update_and_fetch(mx.array(keys[:, :, t : t + 1]),
                                       mx.array(values[:, :, t : t + 1])))
        if t == 130:
            state = cache.engine.proxy
            assert state is not None and state.kf is not None  # float16 keys: a mirror
            held_arrays = [a for a in vars(state).values() if isinstance(a, mx.array)]
            assert held_arrays and all(a.dtype != mx.float64 for a in held_arrays)  # GPUs: none
            held = cache.engine.nbytes
            assert held >= state.nbytes > 0
            assert cache.tokens_kept == 48  # a read: the due eviction runs early
    assert calls["schedule"] == 1 and calls["step"] >= 50, calls
    assert cache.nbytes_bound >= cache.storage_nbytes + held
    assert _check(cache, config, keys) >= 1


@pytest.mark.parametrize("spread,dtype", [(1.5, np.float32), (4.0, np.float64)])
def test_chunk_replay_exps_in_float32_only_when_no_logit_can_underflow(spread, dtype, monkeypatch):
    """Keys of standard deviation ``spread``: narrow logits, the replay's exps and scores in
    float32; wide ones (here up to ~250 apart): float64, where float32 would flush small
    exps to zero. Either way the reference's kept sets, for both fusions, chunked with
    stored rows too."""
    made = []
    replay = proxy_schedule.replay

    def recorded(own, *args):
        made.append(own.dtype.type)
        return replay(own, *args)

    monkeypatch.setattr(proxy_schedule, "replay", recorded)
    keys, values, queries = _stream(150, H=8, seed=5)
    keys = (keys.astype(np.float32) * spread / 2).astype(np.float16)
    compared = 0
    for fusion in ("mean", "max"):
        config = KVCacheConfig(method="morphkv", morphkv_budget=32, morphkv_window=4,
                               morphkv_fusion=fusion, scoring="proxy", engine="mlx")
        compared += _check(_feed(config, keys, values, queries, [100], False), config, keys)
    assert set(made) == {dtype} and compared >= 4
