"""The quality knobs against the NumPy reference: a recency floor (``morphkv_recent``) and
value-weighted scores (``morphkv_value``), with both scorings and any chunking."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from chunked import draw_geometry, draw_stream, feed_in_chunks, reference_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.mlxlm.hooks import queries_by_hand


@st.composite
def knob_streams(draw):
    method = draw(st.sampled_from(["morphkv", "tova", "h2o"]))
    config = KVCacheConfig(
        method=method,
        **draw_geometry(draw, st, recent_span=6),
        morphkv_value=draw(st.booleans()),
        morphkv_fusion=draw(st.sampled_from(["mean", "max"])),
        scoring=draw(st.sampled_from(["proxy", "attention"])),
    )
    keys, queries, cuts = draw_stream(draw, st, config.budget)
    return config, keys, queries, cuts


@pytest.fixture(autouse=True)
def hook_present():
    """Attention scoring asks for the model hook; these tests hand the queries in directly."""
    with queries_by_hand():
        yield


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(knob_streams())
def test_knobs_match_reference_for_any_chunking(case):
    config, keys, queries, cuts = case
    cache = feed_in_chunks(config, keys, queries, cuts)
    for h in range(keys.shape[1]):
        assert cache.kept_positions[0, h].tolist() == reference_for(config, keys, queries, h)


def test_recent_protects_the_newest_tokens():
    rng = np.random.default_rng(1)
    keys = mx.array(rng.standard_normal((1, 1, 200, 8)).astype(np.float32))
    config = KVCacheConfig(morphkv_budget=48, morphkv_window=4, morphkv_recent=32)
    cache = KVCacheBuilder.build(config)
    cache.update_and_fetch(keys, keys)
    kept = cache.kept_positions[0, 0]
    assert set(range(168, 200)) <= set(kept.tolist()) and len(kept) == 48


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(morphkv_window=8, morphkv_recent=4), "morphkv_recent must be >= morphkv_window"),
        (dict(morphkv_budget=40, morphkv_recent=40), r"n_sink \+ recent"),
        (dict(method="streaming_llm", morphkv_value=True), "has none"),
        (dict(morphkv_value=1), "True or False"),
    ],
)
def test_bad_knobs_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCacheConfig(**kwargs).validate()


def test_recommended_preset_is_valid_and_overridable():
    from morphkv import PRESETS, recommended

    config = recommended(128)
    assert config.method == "morphkv" and config.budget == 128
    assert config.recent == 64 and config.morphkv_value
    from morphkv.core.presets import PEAK

    assert config.morphkv_peak == PEAK > 0 and config.morphkv_decay == 1  # issue 20
    assert recommended(128, morphkv_peak=0.0).morphkv_peak == 0
    assert recommended(256, morphkv_window=8).window == 8
    assert PRESETS["paper"](128).recent == PRESETS["paper"](128).window == 8
    with pytest.raises(ValueError, match="morphkv_budget must exceed"):
        recommended(16)
