"""``pin="prompt"``: the cache pins every prefilled token by itself, through plain mlx_lm calls.

Real mlx_lm ``generate_step`` / ``stream_generate`` / ``batch_generate`` / ``BatchGenerator`` and
the server's prompt cache (``bounded_prompt_cache``, mlx_lm's ``LRUPromptCache``) on tiny
random-weight llama models: each prompt's tokens (and its last token, fed alone) are pinned,
generated tokens are not; batch rows pin per row and equal single runs; pins survive extract,
merge, deepcopy, the prompt cache and save/load; a bad saved pin set is refused and nothing is
lost; ``recommended(memory=...)`` pins by itself, the eval arms only when they say so.
"""

from __future__ import annotations

import copy
import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from morphkv import KVCacheConfig, patch_model, recommended
from morphkv.core.pins import MAX_NBYTES, MAX_RANGES
from morphkv.eval.arms import Arm
from morphkv.eval.models import tiny_llama
from tests.test_batch import STEP, _Tok, assert_same_cache, prompts_of, single

PINNED = dict(morphkv_budget=16, morphkv_n_sink=2, morphkv_window=4, pin="prompt")


def ranges(caches) -> list:
    """Every layer's pinned ranges (they are the same in every layer)."""
    out = [c.pins.ranges() for c in caches]
    assert all(r == out[0] for r in out)
    return out[0]


def prompt_pins(start: int, end: int) -> list:
    """What a prompt of positions [start, end) pins: it, and at times the turn's first
    generated token (the second one-token update after the prefill, ``feed.PIN_AFTER``)."""
    return [[[start, end]], [[start, end + 1]]]


def model_for(method="streaming_llm", block=1, **extra):
    config = KVCacheConfig(method=method, morphkv_block=block, **{**PINNED, **extra})
    return patch_model(tiny_llama(2), config)


@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize("method", ["streaming_llm", "h2o", "morphkv"])
def test_a_prompt_is_pinned_and_outlives_the_generated_tokens(method, block):
    model = model_for(method, block=block, scoring="attention", morphkv_budget=24)
    prompt = prompts_of([9])[0]
    tokens, _, caches = single(model, prompt, 40)
    assert ranges(caches) in prompt_pins(0, 9)  # 8 prefilled + the last one fed alone
    kept = caches[0].kept_positions[0, 0]
    assert set(range(9)) <= set(kept.tolist())  # they fit with a block to spare: none went
    assert caches[0].offset >= 9 + 39  # mlx_lm computes one token ahead


def test_plain_mlx_lm_chat_loop_pins_every_turn_and_pins_overflow_by_the_rule():
    """mlx_lm.chat's loop: one prompt cache, each turn feeds only its new tokens."""
    model = model_for()
    caches = model.make_cache()
    turns, expected = prompts_of([6, 11, 4, 13], seed=3), []
    for turn in turns:
        start = caches[0].offset
        list(generate_step(mx.array(turn), model, prompt_cache=caches, max_tokens=5,
                           prefill_step_size=STEP))
        expected.append((start, start + len(turn)))
    start = caches[0].offset
    held = ranges(caches)
    assert len(held) == len(expected)
    assert all([h] in prompt_pins(*e) for h, e in zip(held, expected, strict=True))
    kept = set(caches[0].kept_positions[0, 0].tolist())
    pinned = {p for a, b in held for p in range(a, b)}
    assert len(pinned) > 16  # more pinned than fit: the oldest (recency) pinned went first
    assert max(pinned) in kept and {0, 1} <= kept  # sinks stay, the newest prompt stays
    assert not (kept - pinned) - set(range(start - 6, start))  # unpinned: the newest reply


@pytest.mark.parametrize(("method", "block", "pin_rank"),
                         [(m, b, "rule") for m in ("streaming_llm", "morphkv", "h2o")
                          for b in (1, 4)]
                         + [("streaming_llm", 1, "keydiff"), ("morphkv", 4, "keydiff-span")])
def test_batch_rows_pin_per_row_and_equal_single_runs(method, block, pin_rank):
    """(a 30-token prompt overflows the 16-token budget: pinned tokens rank by pin_rank)"""
    model = model_for(method, block=block, pin_rank=pin_rank)
    prompts, max_tokens = prompts_of([5, 30, 12]), [20, 9, 25]
    res = batch_generate(model, _Tok(), prompts, max_tokens=max_tokens, prefill_step_size=STEP,
                         return_prompt_caches=True, return_token_ids=True)
    for prompt, n, ids, caches in zip(prompts, max_tokens, res.token_ids, res.caches,
                                      strict=True):
        tokens, _, reference = single(model, prompt, n)
        assert ids == tokens
        assert ranges(caches) == ranges(reference)
        assert ranges(caches) in prompt_pins(0, len(prompt))
        assert_same_cache(caches, reference)


def test_rows_joining_leaving_and_the_server_prompt_cache_keep_each_rows_pins():
    """BatchGenerator (the server's loop) with rows joining mid-stream, then each finished
    row kept in the server's prompt cache and fetched back for a second turn."""
    from morphkv.server.run import bounded_prompt_cache

    model = model_for("morphkv", block=4, scoring="attention")
    prompts, max_tokens = prompts_of([7, 19, 3, 26], seed=1), [30, 12, 20, 15]
    gen = BatchGenerator(model, max_tokens=30, prefill_step_size=STEP, completion_batch_size=3,
                         prefill_batch_size=2)
    uids = gen.insert(prompts[:1], max_tokens=max_tokens[:1])
    out, finished = {}, {}
    for step in range(200):
        if step == 4:
            uids += gen.insert(prompts[1:], max_tokens=max_tokens[1:])
        for r in gen.next_generated():
            out.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                finished[r.uid] = r
        if len(finished) == len(prompts):
            break
    gen.close()
    kept = bounded_prompt_cache(10, 10**9)
    for uid, prompt, n in zip(uids, prompts, max_tokens, strict=True):
        tokens, _, reference = single(model, prompt, n)
        assert out[uid] == tokens
        caches = finished[uid].prompt_cache
        assert ranges(caches) == ranges(reference)
        assert ranges(caches) in prompt_pins(0, len(prompt))
        assert_same_cache(caches, reference)
        kept.insert_cache("m", finished[uid].all_tokens, caches)
    # a second turn of the first conversation, from the prompt cache (a deepcopy comes back)
    history = finished[uids[0]].all_tokens
    back, rest = kept.fetch_nearest_cache("m", history + [5, 6, 7])
    assert rest == [5, 6, 7] and ranges(back) == ranges(finished[uids[0]].prompt_cache)
    second, first = back[0].offset, ranges(back)
    gen = BatchGenerator(model, max_tokens=4, prefill_step_size=STEP)
    gen.insert([rest], max_tokens=[4], caches=[back])
    done = None
    for _ in range(50):
        done = next((r for r in gen.next_generated() if r.finish_reason), done)
        if done:
            break
    gen.close()
    assert ranges(done.prompt_cache) in [first + p for p in prompt_pins(second, second + 3)]


def test_deepcopy_save_and_load_keep_pins_and_a_bad_saved_pin_set_is_refused(tmp_path):
    model = model_for()
    _, _, caches = single(model, prompts_of([12])[0], 30)
    held = ranges(caches)
    assert held in prompt_pins(0, 12)
    copied = copy.deepcopy(caches)
    copied[0].pin([40, 41])  # a copy's pins are its own
    assert ranges(caches) == held and copied[0].pins.ranges() == [*held, [40, 42]]
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert ranges(loaded) == held
    np.testing.assert_array_equal(loaded[0].kept_positions, caches[0].kept_positions)
    state = list(caches[0].state)
    before = caches[0].kept_positions
    for bad in ('[[5, 2]]', '[[0, 4], [3, 9]]', '"x"', '[[0, 1.5]]'):
        header = state[0].replace(f'"pinned": {held}', f'"pinned": {bad}')
        assert header != state[0]
        with pytest.raises(ValueError, match="pinned ranges"):
            caches[0].state = [header, *state[1:]]
        assert ranges(caches) == held  # nothing lost
        np.testing.assert_array_equal(caches[0].kept_positions, before)


def test_pins_stay_bounded_in_a_long_chat_and_the_bound_counts_them():
    model = model_for()
    caches = model.make_cache()
    for turn in prompts_of([3] * (MAX_RANGES + 40), seed=4):
        list(generate_step(mx.array(turn), model, prompt_cache=caches, max_tokens=2))
    for c in caches:
        assert len(c.pins.starts) <= MAX_RANGES
        assert c.pins.nbytes <= MAX_NBYTES
        assert c.nbytes <= c.nbytes_bound
    unpinned = patch_model(tiny_llama(2), KVCacheConfig(method="streaming_llm",
                                                        **{**PINNED, "pin": "none"}))
    other = unpinned.make_cache()
    list(generate_step(mx.array(prompts_of([20])[0]), unpinned, prompt_cache=other, max_tokens=2))
    assert other[0].pins.ranges() == []
    assert caches[0].nbytes_bound - other[0].nbytes_bound == MAX_NBYTES


def test_the_memory_preset_pins_and_the_eval_arms_pin_only_when_they_say():
    assert recommended(memory=2**20).pin == "prompt" == recommended(512).pin
    assert Arm.parse("recommended:memory=1M").config(64).pin == "none"
    assert Arm.parse("recommended:memory=1M:pin=prompt").config(64).pin == "prompt"
    with pytest.raises(ValueError, match="pin='always' is unknown"):
        dataclasses.replace(KVCacheConfig(), pin="always").validate()


def test_a_refused_update_pins_nothing():
    model = model_for()
    cache = model.make_cache()[0]
    k = mx.zeros((1, 2, 5, 16))
    with pytest.raises(ValueError):
        cache.update_and_fetch(k, mx.zeros((1, 3, 5, 16)))  # values of another shape
    assert cache.pins.ranges() == [] and cache.pin_next == [0]


def _overflowing_pins(pin_rank: str, method: str, block: int):
    """Pinned chat turns twice the budget: each turn 6 tokens whose keys point one way (a
    template repeated every turn) and, in the first turn only, 2 keys pointing elsewhere (a
    fact said once). Returns (kept positions, the fact's positions)."""
    from morphkv import MorphKVCache

    config = KVCacheConfig(method=method, morphkv_block=block, pin_rank=pin_rank,
                           **{**PINNED, "morphkv_budget": 20})
    cache = MorphKVCache(config)
    rng = np.random.default_rng(5)
    common = rng.standard_normal(16).astype(np.float32)
    fact = (2, 3)
    for turn in range(6):
        keys = common + 0.05 * rng.standard_normal((6, 16)).astype(np.float32)
        if turn == 0:
            keys[list(fact)] = rng.standard_normal((2, 16))  # distinctive directions
        k = mx.array(keys)[None, None]  # (1, 1, 6, 16)
        cache.update_and_fetch(k, k + 1)
        for _ in range(3):  # the model's own tokens, one at a time (unpinned)
            one = mx.array(common + rng.standard_normal(16).astype(np.float32))[None, None, None]
            cache.update_and_fetch(one, one)
    return set(cache.kept_positions[0, 0].tolist()), set(fact)


@pytest.mark.parametrize(("method", "block"),
                         [("streaming_llm", 1), ("streaming_llm", 2), ("keydiff", 1)])
def test_overflowing_pins_rank_by_key_geometry_with_pin_rank_keydiff(method, block):
    """``pin_rank="keydiff"``: once pins alone overflow, the pinned key most like the mean
    goes first, so a fact said once in the oldest turn outlives the repeated template; with
    ``pin_rank="rule"`` (recency) the oldest pinned go, the fact with them."""
    kept, fact = _overflowing_pins("keydiff", method, block)
    assert fact <= kept
    if method == "streaming_llm":
        kept_by_age, _ = _overflowing_pins("rule", method, block)
        assert not fact & kept_by_age


def test_pin_rank_is_validated():
    with pytest.raises(ValueError, match="pin_rank='age' is unknown"):
        KVCacheConfig(pin_rank="age").validate()


def test_pin_replies_pins_a_short_reply_when_the_next_prompt_arrives():
    """``pin_replies=N``: at a prompt, the generated tokens since the last pinned range are
    pinned if at most N (a short answer), not if longer; read from the pins alone, so batches
    and loaded caches keep the policy with no state of their own."""
    from morphkv import MorphKVCache

    cache = MorphKVCache(KVCacheConfig(method="streaming_llm", morphkv_budget=64,
                                       morphkv_n_sink=2, pin="prompt", pin_replies=8))
    rng = np.random.default_rng(0)

    def feed(n):
        k = mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32))
        cache.update_and_fetch(k, k)

    feed(10)  # a prompt: [0, 10)
    for _ in range(5):  # a reply of 5: 10 and 11 pinned with the prompt (PIN_AFTER), 12-14 not
        feed(1)
    assert cache.pins.ranges() == [[0, 12]]
    feed(6)  # the next prompt at 15: the 3-token rest of the reply is pinned with it
    assert cache.pins.ranges() == [[0, 21]]
    for _ in range(20):  # a long reply: 21, 22 pinned; 23-40 (18 > 8) are not
        feed(1)
    feed(4)
    assert cache.pins.ranges() == [[0, 23], [41, 45]]


def test_pin_fit_stops_pinning_replies_once_the_pins_fill_the_budget():
    """``pin_fit``: a short reply is pinned only while the pinned positions, the reply with
    them, fit in the budget; past that the user's turns are still pinned, the replies not."""
    from morphkv import MorphKVCache

    held = {}
    for fit in (False, True):
        cache = MorphKVCache(KVCacheConfig(method="streaming_llm", morphkv_budget=24,
                                           morphkv_n_sink=2, pin="prompt", pin_replies=8,
                                           pin_fit=fit))
        rng = np.random.default_rng(0)
        for n in (10, 1, 1, 1, 1, 1, 6, 1, 1, 1, 1, 1, 4):  # prompt, reply, prompt, reply, ...
            k = mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32))
            cache.update_and_fetch(k, k)
        held[fit] = cache.pins.ranges()
    # the first reply fits (12 pinned + 3 <= 24) either way; the second (23 + 3) only without
    assert held[False] == [[0, 30]]
    assert held[True] == [[0, 23], [26, 30]]
    with pytest.raises(ValueError, match="pin_fit must be True or False"):
        KVCacheConfig(pin_fit=1).validate()


def test_pin_replies_through_mlx_lm():
    """Through mlx_lm's ``generate_step`` with one prompt cache over two turns: a reply of 4
    tokens is pinned when the second prompt arrives, with ``pin_replies`` and not without."""
    from mlx_lm.models.cache import make_prompt_cache

    held = {}
    for n in (0, 8):
        model = model_for("streaming_llm", pin_replies=n, morphkv_budget=64,
                          scoring="attention")
        caches = make_prompt_cache(model)
        first, second = prompts_of([9, 6])
        single(model, first, 4, cache=caches)
        single(model, second, 1, cache=caches)
        held[n] = ranges(caches)
    assert len(held[0]) == 2 and held[8] == [[0, held[0][-1][1]]]


def test_a_pinned_reply_outlives_later_tokens():
    """The reply pinned after it was stored is evicted last: every pinned position is in the
    kept set once later generated tokens overflow the budget."""
    model = model_for("streaming_llm", pin_replies=8, scoring="attention", morphkv_budget=24)
    caches = model.make_cache()
    first, second = prompts_of([9, 6])
    single(model, first, 4, cache=caches)
    single(model, second, 30, cache=caches)  # ~50 tokens seen, 24 held
    kept = caches[0].kept_positions[0, 0].tolist()
    pinned = {p for a, b in ranges(caches) for p in range(a, b)}
    assert len(ranges(caches)) == 1 and pinned <= set(kept), (pinned, kept)
    assert caches[0].tokens_seen > 40
