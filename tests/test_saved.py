"""Saved caches are untrusted: edited or corrupted states are refused with a ValueError that
names the problem, and the cache being loaded into is left as it was."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as mlx_cache

from morphkv import KVCacheBuilder, KVCacheConfig, MorphKVCache

SMALL = dict(morphkv_budget=12, morphkv_n_sink=2, morphkv_window=4)


def filled(method="morphkv", T=30):
    """A filled cache."""
    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((1, 2, T, 8)).astype(np.float16))
    cache = KVCacheBuilder.build(KVCacheConfig(method=method, **SMALL))
    cache.update_and_fetch(k[:, :, : T - 1], k[:, :, : T - 1])
    cache.update_and_fetch(k[:, :, T - 1 :], k[:, :, T - 1 :])
    return cache


def arrays_of(state) -> dict:
    """The engine's arrays of a saved state as NumPy arrays, by name."""
    names = [e.split(":")[0] for e in state[3].removeprefix("device:").split(";")]
    return {n: np.array(a) for n, a in zip(names, state[4:], strict=True)}


def with_arrays(state, arrays):
    names = sorted(arrays)
    spec = "device:" + ";".join(
        f"{n}:{arrays[n].dtype}:{'x'.join(map(str, arrays[n].shape))}" for n in names)
    return [state[0], state[1], state[2], spec, *(mx.array(arrays[n]) for n in names)]


def load(state):
    cache = MorphKVCache(KVCacheConfig())
    cache.state = state
    return cache


@pytest.mark.parametrize("method", ["morphkv", "h2o", "streaming_llm", "full", "tova"])
def test_a_saved_state_round_trips(method, tmp_path):
    cache = filled(method)
    path = str(tmp_path / "c.safetensors")
    mlx_cache.save_prompt_cache(path, [cache])
    loaded = mlx_cache.load_prompt_cache(path)[0]
    np.testing.assert_array_equal(loaded.kept_positions, cache.kept_positions)


@pytest.mark.parametrize("edit", [
    lambda s: [json.dumps({**json.loads(s[0]), "engine": "host"}), *s[1:]],
    lambda s: [*s[:3], s[3].removeprefix("device:"), *s[4:]],
], ids=["host config", "host spec"])
def test_a_host_engine_save_is_refused_with_why(edit):
    """Caches saved by the removed float64 host engine: refused, saying why."""
    with pytest.raises(ValueError, match="host engine, which was removed"):
        load(edit(filled().state))


def edits():
    """(name, function state -> edited state) pairs that must be refused."""

    def config(**change):
        def edit(state):
            fields = json.loads(state[0])
            fields.update(change)
            return [json.dumps(fields), *state[1:]]

        return edit

    def array(name, fn):
        def edit(state):
            a = arrays_of(state)
            a[name] = fn(a[name].copy())
            return with_arrays(state, a)

        return edit

    def dup(p):
        p[0, 1] = p[0, 0]
        return p

    return [
        ("budget below the kept count", config(morphkv_budget=8)),
        ("method changed", config(method="h2o")),
        ("unknown field", config(surprise=1)),
        ("bad method", config(method="nope")),
        ("position out of range", array("positions", lambda p: p + 10_000)),
        ("negative position", array("positions", lambda p: p - 1_000)),
        ("a position twice", array("positions", dup)),
        ("slots past storage", array("counters", lambda s: s + np.array([0, 50, 0], np.int32))),
        ("seen shrunk", array("counters", lambda s: s - np.array([20, 0, 0], np.int32))),
        ("slots past the budget", array("counters", lambda s: s + np.array([0, 1, 0], np.int32))),
        ("scale zero", array("scale", lambda s: s * 0)),
        ("positions as float", array("positions", lambda p: p.astype(np.float32))),
        ("spec mangled", lambda s: [*s[:3], s[3].replace(":", "", 2), *s[4:]]),
        ("array missing", lambda s: [*s[:-1]]),
        ("keys not 4-d", lambda s: [s[0], s[1][0], *s[2:]]),
        ("values of another length", lambda s: [s[0], s[1], s[2][:, :, :3], *s[3:]]),
        ("too short", lambda s: s[:2]),
    ]


@pytest.mark.parametrize("name, edit", edits(), ids=[n for n, _ in edits()])
def test_edited_state_is_refused_and_nothing_changes(name, edit):
    state = filled().state
    target = filled("streaming_llm")
    before = target.kept_positions.copy()
    with pytest.raises(ValueError):
        target.state = edit(state)
    np.testing.assert_array_equal(target.kept_positions, before)
    assert target.config.method == "streaming_llm"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_byte_edits_never_crash_or_mislead(data):
    state = filled().state
    arrays = arrays_of(state)
    name = data.draw(st.sampled_from(sorted(arrays)))
    raw = arrays[name].copy().reshape(-1).view(np.uint8)
    if raw.size == 0:
        return
    i = data.draw(st.integers(0, raw.size - 1))
    raw[i] = data.draw(st.integers(0, 255))
    arrays[name] = raw.view(arrays[name].dtype).reshape(arrays[name].shape)
    try:
        cache = load(with_arrays(state, arrays))
    except ValueError:
        return
    # accepted: the cache is consistent and keeps working within its budget
    k = mx.array(np.ones((1, 2, 3, 8), np.float16))
    cache.update_and_fetch(k, k)
    kept = cache.kept_positions
    assert kept.shape[2] <= cache.config.budget
    assert (kept >= 0).all() and (kept < cache.offset).all()


def device_edits():
    """Edits of an MLX engine state (``morphkv.core.device_saved``) that must be refused."""

    def array(i, fn):
        def edit(state):
            names = state[3].split(";")
            index = 4 + [n.split(":")[0] for n in names].index(i)
            return [*state[:index], fn(state[index]), *state[index + 1 :]]

        return edit

    return [
        ("position out of range", array("positions", lambda p: p + 10_000)),
        ("a position twice",
         array("positions", lambda p: mx.concatenate([p[:, :1], p[:, :-1]], 1))),
        ("slots past the budget", array("counters", lambda c: c + mx.array([0, 5, 0], mx.int32))),
        ("seen shrunk", array("counters", lambda c: c - mx.array([20, 0, 0], mx.int32))),
        ("positions as float", array("positions", lambda p: p.astype(mx.float32))),
        ("a negative peak", array("accumulated", lambda a: a - 1)),
        ("scale zero", array("scale", lambda s: s * 0)),
        ("array missing", lambda s: [*s[:-1]]),
    ]


@pytest.mark.parametrize("name, edit", device_edits(), ids=[n for n, _ in device_edits()])
def test_edited_device_state_is_refused_and_nothing_changes(name, edit):
    state = filled("h2o").state
    assert state[3].startswith("device:")
    target = filled("streaming_llm")
    before = target.kept_positions.copy()
    with pytest.raises(ValueError):
        target.state = edit(state)
    np.testing.assert_array_equal(target.kept_positions, before)
