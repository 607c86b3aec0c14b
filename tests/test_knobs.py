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


def test_recommended_is_one_rule_whichever_argument_it_gets():
    """Issue 42: recommended(budget) and recommended(memory=...) are one rule (a pinned
    decaying peak in blocks of 16, one KeyDiff vote among overflowing pins); the argument says
    only how much is kept."""
    import dataclasses

    from morphkv import PRESETS, recommended

    by_tokens, by_bytes = recommended(128), recommended(memory=2**20)
    rule = ("method", "morphkv_n_sink", "pin", "pin_rank", "morphkv_block", "morphkv_window",
            "morphkv_decay")
    assert [getattr(by_tokens, f) for f in rule] == [getattr(by_bytes, f) for f in rule]
    assert (by_tokens.method, by_tokens.pin, by_tokens.pin_rank, by_tokens.morphkv_decay,
            by_tokens.morphkv_block) == ("peak", "prompt", "vote", 0.95, 16)
    # another rule asked of the preset: its own decay and block, the preset's pins
    other = recommended(128, method="streaming_llm")
    assert (other.morphkv_decay, other.morphkv_block, other.pin) == (1.0, 1, "prompt")
    assert (by_tokens.budget, by_tokens.kv_bits, by_tokens.kv_memory) == (128, None, None)
    assert (by_bytes.budget, by_bytes.kv_bits, by_bytes.kv_memory) == (0, 8, 2**20)
    assert dataclasses.replace(recommended(128, pin="none"), pin="prompt") == by_tokens
    assert PRESETS["recommended"] is recommended


def test_tuned_and_paper_presets_are_valid_and_overridable():
    from morphkv import PRESETS
    from morphkv.core.presets import PEAK

    tuned = PRESETS["tuned"]
    config = tuned(128)
    assert config.method == "morphkv" and config.budget == 128
    assert config.recent == 64 and config.morphkv_value
    assert config.morphkv_peak == PEAK > 0 and config.morphkv_decay == 1  # issue 20
    assert tuned(128, morphkv_peak=0.0).morphkv_peak == 0
    assert tuned(256, morphkv_window=8).window == 8
    assert PRESETS["paper"](128).recent == PRESETS["paper"](128).window == 8
    with pytest.raises(ValueError, match="morphkv_budget must exceed"):
        tuned(16)


def test_every_config_field_has_one_knob_name():
    import dataclasses

    from morphkv.core.knobs import FIELDS, field_of, flag

    assert sorted(FIELDS.values()) == sorted(f.name for f in dataclasses.fields(KVCacheConfig))
    for name, field in FIELDS.items():  # the name, the field and an old spelling: one field
        assert field_of(name) == field_of(field) == field
    assert (flag("n_sink"), flag("bits"), flag("morphkv_block")) == ("--sinks", "--kv-bits",
                                                                     "--block")
    with pytest.raises(ValueError, match="names no KVCacheConfig field"):
        field_of("blocks")


def _flags(*argv):
    import argparse

    from morphkv.runtime.cache_flags import add_cache_flags, config_from_flags

    parser = argparse.ArgumentParser()
    add_cache_flags(parser, 256)
    return config_from_flags(parser.parse_args(list(argv)))


# the spellings README.md and docs/*.md use, and the config field each one sets
DOCUMENTED_FLAGS = [
    (["--block", "4"], "morphkv_block", 4),
    (["--sinks", "2"], "morphkv_n_sink", 2),
    (["--window", "8"], "morphkv_window", 8),
    (["--recent", "32"], "morphkv_recent", 32),
    (["--preset", "tuned", "--peak", "0.25"], "morphkv_peak", 0.25),
    (["--preset", "tuned", "--peak", "1", "--decay", "0.999"], "morphkv_decay", 0.999),
    (["--preset", "tuned", "--pool", "3"], "morphkv_pool", 3),
    (["--no-value"], "morphkv_value", False),
    (["--fusion", "max"], "morphkv_fusion", "max"),
    (["--scoring", "proxy"], "scoring", "proxy"),
    (["--engine", "mlx"], "engine", "mlx"),
    (["--kv-bits", "4", "--kv-group-size", "32"], "kv_group_size", 32),
    (["--kv-bits", "8"], "kv_bits", 8),
    (["--kv-memory", "20M"], "kv_memory", 20 * 2**20),
    (["--method", "keydiff"], "method", "keydiff"),
    (["--preset", "paper"], "morphkv_block", 8),
    (["--budget", "64"], "morphkv_budget", 64),
]


@pytest.mark.parametrize("argv, field, value", DOCUMENTED_FLAGS)
def test_documented_flags_set_their_field(argv, field, value):
    assert getattr(_flags(*argv), field) == value


DOCUMENTED_ARMS = [  # (spec, the field it sets, the value) at budget 128
    ("recommended:block=1", "morphkv_block", 1),
    ("recommended:engine=mlx", "engine", "mlx"),
    ("streaming_llm:memory=f16:bits=8", "kv_bits", 8),
    ("recommended:memory=f16:bits=None", "kv_bits", None),
    ("recommended:memory=64M", "kv_memory", 64 * 2**20),
    ("recommended:memory=f16", "method", "peak"),  # issue 42, round 12
    ("recommended:memory=f16:method=morphkv:peak=1", "morphkv_peak", 1),  # its first
    ("tuned:peak=0.25:decay=0.999", "morphkv_decay", 0.999),
    ("peak:window=1:recent=32:value=true:pool=3", "morphkv_pool", 3),
    ("morphkv:recent=0.5:value=true:attn", "morphkv_recent", 64),
    ("morphkv:max:32:attn", "morphkv_window", 32),
    ("morphkv:max:32:attn", "morphkv_fusion", "max"),
    ("h2o:scoring=attention", "scoring", "attention"),
    ("tova:morphkv_n_sink=2", "morphkv_n_sink", 2),
    ("morphkv:sinks=2", "morphkv_n_sink", 2),
    ("morphkv:n_sink=2", "morphkv_n_sink", 2),
    ("morphkv:kv_bits=8", "kv_bits", 8),
    ("keydiff:memory=f16", "method", "keydiff"),
]


@pytest.mark.parametrize("spec, field, value", DOCUMENTED_ARMS)
def test_documented_arm_spellings_set_their_field(spec, field, value):
    from morphkv.eval.arms import Arm

    assert getattr(Arm.parse(spec).config(128), field) == value


def test_flag_errors_name_the_flags():
    from morphkv.runtime.argtypes import UsageError

    with pytest.raises(UsageError, match=r"--budget must .*--sinks \+ --recent \+ --block"):
        _flags("--budget", "64", "--recent", "40", "--block", "30")
    with pytest.raises(UsageError, match="--pool pools attention scores"):
        _flags("--method", "keydiff", "--pool", "3")


def test_an_unknown_fusion_is_refused_for_every_rule():
    from morphkv import KVCacheConfig

    for method in ("h2o", "morphkv", "streaming_llm"):
        with pytest.raises(ValueError, match="morphkv_fusion='median' is unknown"):
            KVCacheConfig(method=method, morphkv_fusion="median").validate()
