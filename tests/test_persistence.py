"""Persistence levers (issue 20) against the NumPy reference: peak attention (``method="peak"``,
optionally decaying), its fusion with the window score (``morphkv_peak``), and span pooling
(``morphkv_pool``), with both scorings, value weighting and any chunking."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from chunked import draw_geometry, draw_stream, feed_in_chunks, reference_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.core.rules import Peak, Pooled, WindowAttention, make_rule
from morphkv.mlxlm.hooks import queries_by_hand


@st.composite
def persistence_streams(draw):
    method = draw(st.sampled_from(["peak", "morphkv", "tova", "h2o"]))
    peak = draw(st.sampled_from([0.0, 0.25, 1.0])) if method in ("morphkv", "tova") else 0.0
    decay = 1.0
    if method == "peak" or peak:
        decay = draw(st.sampled_from([1.0, 0.99, 0.5]))
    config = KVCacheConfig(
        method=method,
        **draw_geometry(draw, st, recent_span=5),
        morphkv_value=draw(st.booleans()),
        morphkv_fusion=draw(st.sampled_from(["mean", "max"])),
        morphkv_peak=peak,
        morphkv_decay=decay,
        morphkv_pool=draw(st.sampled_from([1, 3, 5])),
        scoring=draw(st.sampled_from(["proxy", "attention"])),
    ).validate()
    keys, queries, cuts = draw_stream(draw, st, config.budget)
    return config, keys, queries, cuts


@pytest.fixture(autouse=True)
def hook_present():
    with queries_by_hand():
        yield


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(persistence_streams())
def test_persistence_matches_reference_for_any_chunking(case):
    config, keys, queries, cuts = case
    cache = feed_in_chunks(config, keys, queries, cuts)
    for h in range(keys.shape[1]):
        assert cache.kept_positions[0, h].tolist() == reference_for(config, keys, queries, h)


@pytest.mark.parametrize("chunks", [[], [7, 40], list(range(1, 60))])
def test_a_spike_survives_under_peak_and_not_under_the_window(chunks):
    """Token 10's key is what every query at steps 20-24 looks for, then nobody does: the
    window rule forgets it once those queries leave the window, the peak rule keeps it."""
    rng = np.random.default_rng(3)
    T, D = 60, 8
    keys = 0.1 * rng.standard_normal((1, 1, T, D)).astype(np.float32)
    keys[0, 0, 10] = 0
    keys[0, 0, 10, 0] = 6.0
    queries = 0.1 * rng.standard_normal((1, 1, 2, T, D)).astype(np.float32)
    queries[0, 0, :, 11:15, 0] = 6.0
    kept = {}
    for method, extra in (("morphkv", {}), ("peak", {}), ("morphkv", {"morphkv_peak": 0.5})):
        config = KVCacheConfig(method=method, morphkv_budget=16, morphkv_n_sink=2,
                               morphkv_window=4, morphkv_recent=8, scoring="attention", **extra)
        cache = feed_in_chunks(config, keys, queries, chunks)
        kept[method + str(extra)] = set(cache.kept_positions[0, 0].tolist())
        want = reference_for(config.validate(), keys, queries, 0)
        assert cache.kept_positions[0, 0].tolist() == want
    assert 10 not in kept["morphkv{}"]
    assert 10 in kept["peak{}"] and 10 in kept["morphkv{'morphkv_peak': 0.5}"]


def test_rules_are_built_from_the_fields_and_the_paper_rule_is_unchanged():
    paper = make_rule(KVCacheConfig())
    assert type(paper) is WindowAttention and not paper.observes and paper.peak == 0
    fused = make_rule(KVCacheConfig(morphkv_peak=0.5, morphkv_decay=0.9))
    assert fused.observes and (fused.peak, fused.decay) == (0.5, 0.9)
    pooled = make_rule(KVCacheConfig(method="peak", morphkv_pool=5))
    assert isinstance(pooled, Pooled) and isinstance(pooled.inner, Peak) and pooled.kernel == 5
    assert pooled.observes and pooled.attention


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(morphkv_peak=-1.0), "morphkv_peak must be a finite number >= 0"),
        (dict(morphkv_peak=float("nan")), "morphkv_peak must be"),
        (dict(method="h2o", morphkv_peak=0.5), "has none"),
        (dict(morphkv_decay=0.5), "set morphkv_peak > 0"),
        (dict(method="peak", morphkv_decay=0.0), r"morphkv_decay must be in \(0, 1\]"),
        (dict(method="peak", morphkv_decay=1.5), r"morphkv_decay must be in \(0, 1\]"),
        (dict(morphkv_pool=4), "odd int"),
        (dict(morphkv_pool=0), "odd int"),
        (dict(method="streaming_llm", morphkv_pool=3), "pools attention scores"),
    ],
)
def test_bad_persistence_settings_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCacheConfig(**kwargs).validate()


def test_peak_state_is_counted_and_bounded():
    config = KVCacheConfig(method="peak", morphkv_budget=24, morphkv_window=4, scoring="proxy")
    cache = KVCacheBuilder.build(config)
    keys = mx.array(np.random.default_rng(0).standard_normal((1, 2, 100, 8)).astype(np.float32))
    cache.update_and_fetch(keys, keys)
    assert cache.kept_positions.shape == (1, 2, 24)
    assert cache.engine.accumulated.shape[1] <= 25 and cache.engine.nbytes > 0
