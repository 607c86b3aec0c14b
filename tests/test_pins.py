"""Pinned positions (``MorphKVCache.pin``, ``morphkv.pin``): evicted last by the engine, for
every rule and block, as the NumPy reference decides with the same pins; kept while they fit;
carried through copies and conversions; bad positions refused with the problem named."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import morphkv
from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.core.rules import METHODS
from morphkv.mlxlm.hooks import attention_step, queries_by_hand
from tests.chunked import draw_config
from tests.test_device import check_kept

EVICTING = sorted(set(METHODS) - {"full", "random"})
SCALE = 0.35


def feed(config, keys, queries, values, cuts, pins):
    cache = KVCacheBuilder.build(config)
    cache.pin(pins)
    start = 0
    for end in [*cuts, keys.shape[2]]:
        if end > start:
            k, v, q = (mx.array(x[:, :, start:end]) for x in (keys, values, queries))
            mx.eval(attention_step(cache, q, k, v, SCALE))
            start = end
    return cache


@st.composite
def cases(draw):
    config = draw_config(draw, EVICTING, [1, 2, 3, 8], slack=12, engine="mlx")
    T = draw(st.integers(config.budget, 3 * config.budget + 2 * config.block))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    G, H, D = draw(st.integers(1, 2)), draw(st.integers(1, 2)), 8
    keys = (rng.standard_normal((1, H, T, D)) * 2).astype(np.float32)
    queries = rng.standard_normal((1, H * G, T, D)).astype(np.float32)
    share = draw(st.sampled_from([0.1, 0.3, 0.7]))  # 0.7: more pins than fit
    pins = np.nonzero(rng.random(T) < share)[0]
    cuts = sorted(draw(st.lists(st.integers(1, max(1, T - 1)), max_size=4)))
    return config, keys, queries, keys + 1, cuts, pins


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_pinned_tokens_go_last_as_the_reference(case):
    config, keys, queries, values, cuts, pins = case
    with queries_by_hand(), np.errstate(all="ignore"):
        cache = feed(config, keys, queries, values, cuts, pins)
        check_kept(cache, config, keys, queries, values, pins)


@pytest.mark.parametrize("method", EVICTING)
def test_pinned_tokens_stay_while_they_fit(method):
    """Every rule: 20 pinned positions of 300 tokens fed to a 64-token cache (4
    sinks, 16 recent, block 8) all remain; without pins most of them go."""
    rng = np.random.default_rng(5)
    T, pins = 300, np.arange(40, 240, 10)
    keys = rng.standard_normal((1, 2, T, 16)).astype(np.float32)
    queries = rng.standard_normal((1, 4, T, 16)).astype(np.float32)
    config = KVCacheConfig(method=method, morphkv_budget=64, morphkv_recent=16,
                           morphkv_block=8, scoring="attention")
    with queries_by_hand():
        pinned = feed(config, keys, queries, keys, [100, 200], pins).kept_positions
        plain = feed(config, keys, queries, keys, [100, 200], []).kept_positions
    for h in range(2):
        assert set(pins) <= set(pinned[0, h].tolist())
        assert len(set(pins) & set(plain[0, h].tolist())) < len(pins)


def test_pins_survive_copies_and_conversions_and_pin_skips_mlx_lm_caches():
    from mlx_lm.models.cache import KVCache

    rng = np.random.default_rng(2)
    keys = rng.standard_normal((1, 2, 200, 64)).astype(np.float32)
    config = KVCacheConfig(morphkv_budget=48, morphkv_recent=8, morphkv_block=4, engine="mlx")
    caches = [KVCacheBuilder.build(config), KVCache()]
    assert morphkv.pin(caches, range(20, 40)) == 1
    cache = caches[0]
    k = mx.array(keys[:, :, :100])
    cache.update_and_fetch(k, k)
    for other in (copy.deepcopy(cache), cache.to_quantized(64, 8)):
        other.update_and_fetch(mx.array(keys[:, :, 100:]), mx.array(keys[:, :, 100:]))
        kept = other.kept_positions
        assert all(set(range(20, 40)) <= set(kept[0, h].tolist()) for h in range(2))


@pytest.mark.parametrize("bad, words", [([-1, 3], "[0, "), ([1.5], "integers"),
                                        ([[1, 2]], "1-d"), ([1 << 41], "[0, ")])
def test_bad_positions_are_refused_and_lose_nothing(bad, words):
    cache = KVCacheBuilder.build(KVCacheConfig(morphkv_budget=32))
    cache.pin([5, 6])
    with pytest.raises(ValueError, match="pin: positions") as e:
        cache.pin(bad)
    assert words in str(e.value)
    assert cache.pins.positions().tolist() == [5, 6]


@pytest.mark.slow
def test_user_positions_are_the_user_turns_of_the_template():
    from smollm2_fixture import load_embedded

    from morphkv.mlxlm.turns import user_positions

    _, tok = load_embedded()
    messages = [{"role": "user", "content": "My cat is called Ziggy. Hi!"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "Tell me a joke."}]
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=False))
    pos = user_positions(tok, messages, offset=0)
    text = tok.decode([ids[p] for p in pos])
    assert text.startswith("My cat is called Ziggy. Hi!") and "Tell me a joke." in text
    assert "How can I help" not in text and "SmolLM" not in text  # not the reply, not the system
    assert (user_positions(tok, messages, offset=7) == pos + 7).all()
    short = user_positions(tok, messages, replies=16)  # the short reply pinned too
    assert "How can I help" in tok.decode([ids[p] for p in short]) and len(short) > len(pos)
    assert (user_positions(tok, messages, replies=3) == pos).all()  # longer than 3 tokens
    # a reply counts as its text's tokens, as the cache's pin_replies counts a generated one
    n = len(tok.encode("Hello! How can I help?", add_special_tokens=False))
    assert len(user_positions(tok, messages, replies=n)) > len(pos)
    assert (user_positions(tok, messages, replies=n - 1) == pos).all()


def test_pin_suffixes_of_arm_specs():
    from morphkv.eval.arms import unpinned

    assert unpinned("recommended:memory=f16+pin24") == ("recommended:memory=f16", True, 24)
    assert unpinned("recommended+pin") == ("recommended", True, 0)
    assert unpinned("h2o:block=16") == ("h2o:block=16", False, 0)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    from morphkv.mlxlm.turns import user_positions

    class Rewriting:  # renders every message but the last in upper case (as thinking-strippers do)
        def apply_chat_template(self, messages, add_generation_prompt=False):
            text = "".join((m["content"].upper() if i < len(messages) - 1 else m["content"]) + "|"
                           for i, m in enumerate(messages))
            return [ord(c) for c in text]

    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ValueError, match="cannot be located"):
        user_positions(Rewriting(), msgs)


def test_a_long_chats_pins_stay_bounded_by_what_the_cache_holds():
    """200 one-token-apart pinned ranges through a 48-token cache: ranges that hold nothing
    kept and nothing to come are dropped, so the pins' bytes stay bounded; the kept tokens are
    the same as with every range kept."""
    from morphkv.core.pins import PRUNE_AT, Pins

    rng = np.random.default_rng(4)
    keys = rng.standard_normal((1, 2, 800, 16)).astype(np.float32)
    config = KVCacheConfig(morphkv_budget=48, morphkv_recent=8, morphkv_block=4)
    cache = KVCacheBuilder.build(config)
    every = Pins()
    for t in range(0, 800, 4):
        cache.pin([t])
        every.add([t])
        k = mx.array(keys[:, :, t : t + 4])
        cache.update_and_fetch(k, k)
        # at most the ranges it still holds a token of (<= budget per KV head) or the
        # pruning threshold, plus the new one
        assert len(cache.pins.starts) <= max(PRUNE_AT, 2 * 48) + 1
    assert cache.pins.nbytes <= 16 * 97 < every.nbytes
    held = set(cache.kept_positions.reshape(-1).tolist())
    assert {p for p in every.positions().tolist() if p in held} <= set(
        cache.pins.positions().tolist())
