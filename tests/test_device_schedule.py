"""Chunks of rules that read no attention (recency, KeyDiff, pinned with ``pin_rank`` "rule"
or "keydiff") are scheduled (``core.device_schedule``): every eviction decided first, then one
attention with each query's visibility. Their outputs and kept sets are those of the same
tokens fed one at a time (the per-token path), and the kept sets are the reference's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.core import device_schedule
from morphkv.mlxlm.hooks import attention_step, queries_by_hand
from tests.test_device import check_kept

SCALE = 0.35


def run(config, keys, queries, values, cuts, pins):
    """(outputs (1, n_heads, T, D), cache) of the stream fed in chunks ending at ``cuts``."""
    cache = KVCacheBuilder.build(config)
    cache.pin(pins)
    outs, start = [], 0
    with queries_by_hand():
        for end in [*cuts, keys.shape[2]]:
            if end > start:
                k, v, q = (mx.array(x[:, :, start:end]) for x in (keys, values, queries))
                outs.append(attention_step(cache, q, k, v, SCALE))
                start = end
    return np.array(mx.concatenate(outs, axis=2)), cache


@st.composite
def cases(draw):
    method = draw(st.sampled_from(["streaming_llm", "sliding_window", "keydiff"]))
    block = draw(st.sampled_from([1, 1, 2, 5]))
    n_sink, recent = draw(st.integers(0, 4)), draw(st.integers(1, 8))
    budget = draw(st.integers(n_sink + recent + block, n_sink + recent + block + 20))
    config = KVCacheConfig(
        method=method, morphkv_budget=budget, morphkv_n_sink=n_sink, morphkv_window=1,
        morphkv_recent=recent, morphkv_block=block, scoring="attention", engine="mlx",
        pin_rank=draw(st.sampled_from(["rule", "keydiff"])),
        kv_bits=draw(st.sampled_from([None, None, 8])), kv_group_size=32)
    T = draw(st.integers(2, 3 * budget + 10))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    G, H = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    keys = (rng.standard_normal((1, H, T, 32)) * 2).astype(np.float32)
    queries = rng.standard_normal((1, H * G, T, 32)).astype(np.float32)
    values = rng.standard_normal((1, H, T, 32)).astype(np.float32)
    pins = np.nonzero(rng.random(T) < draw(st.sampled_from([0.0, 0.3, 0.9])))[0]
    cuts = sorted(draw(st.lists(st.integers(1, max(1, T - 1)), min_size=1, max_size=3)))
    return config, keys, queries, values, cuts, pins


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_a_scheduled_chunk_is_the_per_token_rule(case):
    config, keys, queries, values, cuts, pins = case
    chunked_out, chunked = run(config, keys, queries, values, cuts, pins)
    token_out, token = run(config, keys, queries, values, list(range(1, keys.shape[2])), pins)
    np.testing.assert_array_equal(chunked.kept_positions, token.kept_positions)
    np.testing.assert_allclose(chunked_out, token_out, rtol=1e-4, atol=1e-5)
    if config.pin_rank == "rule" and config.kv_bits is None:
        check_kept(chunked, config, keys, queries, values, pins)


def test_the_scheduled_path_is_taken_and_ranks_overflowing_pins_by_keys(monkeypatch):
    """A fully pinned prompt over the budget (what ``recommended`` prefills): every pick is
    a key-ranked one among the pinned, decided once per chunk."""
    calls = []
    schedule = device_schedule.schedule
    monkeypatch.setattr(device_schedule, "schedule",
                        lambda *a: calls.append(a[2]) or schedule(*a))
    config = KVCacheConfig(method="streaming_llm", morphkv_budget=40, pin="prompt",
                           pin_rank="keydiff", scoring="attention", engine="mlx")
    rng = np.random.default_rng(0)
    keys, values = (rng.standard_normal((1, 2, 100, 16)).astype(np.float32) for _ in range(2))
    queries = rng.standard_normal((1, 6, 100, 16)).astype(np.float32)
    out, cache = run(config, keys, queries, values, [70], [])
    assert calls == [70, 30]
    kept = cache.kept_positions
    assert kept.shape == (1, 2, 40) and not np.array_equal(kept[0, 0], kept[0, 1])
    assert not np.array_equal(kept[0, 0], np.r_[0:4, 68:100])  # not recency: key geometry


@pytest.mark.parametrize("method", ["h2o", "morphkv"])
def test_rules_that_read_attention_are_not_scheduled(method):
    engine = KVCacheBuilder.build(KVCacheConfig(method=method, morphkv_budget=32,
                                                scoring="attention", engine="mlx"))
    with queries_by_hand():
        k = mx.zeros((1, 1, 4, 8))
        attention_step(engine, mx.zeros((1, 1, 4, 8)), k, k, SCALE)
    assert not device_schedule.fits(engine.engine)


def test_recency_leading_evictions_at_once_are_the_loop_s(monkeypatch):
    """``schedule``'s shortcut (recency's oldest free rows taken at once, ``_oldest_first``)
    decides exactly what the per-token loop alone decides: pins, sinks, blocks, short rows."""
    from types import SimpleNamespace

    from morphkv.core.pins import Pins
    from morphkv.core.rules import make_rule

    rng = np.random.default_rng(7)
    loop_only = lambda c, pos, free, t0, n0, k, evicted: 0  # noqa: E731
    for _ in range(300):
        block, n_sink, recent = int(rng.choice([1, 1, 2, 5])), int(rng.integers(0, 5)), int(
            rng.integers(1, 9))
        budget = int(rng.integers(n_sink + recent + block, n_sink + recent + block + 25))
        config = KVCacheConfig(method=str(rng.choice(["streaming_llm", "sliding_window"])),
                               morphkv_budget=budget, morphkv_n_sink=n_sink, morphkv_window=1,
                               morphkv_recent=recent, morphkv_block=block, engine="mlx",
                               scoring="attention", pin_rank=str(rng.choice(["rule", "keydiff"])))
        R, n0, k = int(rng.integers(1, 4)), int(rng.integers(0, budget + 1)), int(
            rng.integers(1, 3 * budget))
        t0 = n0 + int(rng.integers(0, 40))
        pos0 = np.stack([rng.permutation(rng.choice(t0, n0, replace=False)) if n0 else
                         np.zeros(0, int) for _ in range(R)]).astype(np.int32).reshape(R, n0)
        pins = Pins()
        pins.add(np.nonzero(rng.random(t0 + k) < rng.choice([0.0, 0.1, 0.5, 0.9]))[0])
        keys = rng.standard_normal((R, n0 + k, 8)).astype(np.float32)
        got = []
        for shortcut in (True, False):
            if not shortcut:
                monkeypatch.setattr(device_schedule, "_oldest_first", loop_only)
            engine = SimpleNamespace(config=config, seen=t0, pins=pins, rows=R, due=False,
                                     rule=make_rule(config))
            out = device_schedule.schedule(engine, pos0, k, lambda keys=keys: keys)
            got.append((*out, engine.due))
        (ev, kept, m, due), (ev2, kept2, m2, due2) = got
        np.testing.assert_array_equal(ev, ev2)
        np.testing.assert_array_equal(kept, kept2)
        assert (m, due) == (m2, due2)
        monkeypatch.undo()
