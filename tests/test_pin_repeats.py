"""``pin_repeats``: a prompt's runs of tokens an earlier prompt of the row held are not pinned.

The run finder on its own, then real mlx_lm calls on tiny random-weight llama models: the chat
loop (one prompt cache, a template re-sent every turn), the server's prompt cache and
``BatchGenerator`` (the row's memory travels with its pins through extract, the prompt cache's
deepcopy and merge), save and load (a bad saved memory is refused, nothing lost), the vote, the
bound, the config and the flag.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from morphkv import KVCacheConfig, patch_model
from morphkv.core import repeats
from morphkv.eval.models import tiny_llama

TEMPLATE, END = list(range(200, 206)), list(range(210, 216))  # a chat template's two halves
STEP = 64  # a turn is one prefill step (mlx_lm's default: 2,048)


def model_for(n=4, **extra):
    config = KVCacheConfig(**{**dict(method="streaming_llm", morphkv_budget=24, morphkv_n_sink=2,
                                     morphkv_window=4, pin="prompt", pin_repeats=n), **extra})
    return patch_model(tiny_llama(2), config)


def turn(words) -> list[int]:
    return TEMPLATE + list(words) + END


def pinned(caches) -> set[int]:
    out = [c.pins.ranges() for c in caches]
    assert all(r == out[0] for r in out)  # every layer pins alike
    return {p for a, b in out[0] for p in range(a, b)}


def test_runs_heard_before_are_found_and_the_memory_is_bounded_newest_last():
    heard = repeats.remember(np.zeros(0, np.uint32), repeats.grams([1, 2, 3, 4, 5, 6], 3))
    covered, _ = repeats.repeated(np.array([9, 2, 3, 4, 8, 5, 6, 7]), heard, 3)
    assert covered.tolist() == [False, True, True, True, False, False, False, False]
    covered, g = repeats.repeated(np.array([1, 2]), heard, 3)  # shorter than a run
    assert covered.tolist() == [False, False] and g.size == 0
    assert repeats.grams([5, 6, 7], 3)[0] != repeats.grams([7, 6, 5], 3)[0]  # order counts
    many = repeats.remember(heard, repeats.grams(np.arange(1000), 3))
    assert many.size == repeats.HEARD and many[-1] == repeats.grams([997, 998, 999], 3)[0]
    again = repeats.remember(many, heard)  # heard again: now the newest, nothing doubled
    assert again.size == repeats.HEARD and set(again[-heard.size:]) == set(heard)


def test_the_chat_loop_pins_the_template_once_and_every_turns_words():
    """mlx_lm.chat's loop: each turn feeds its template and words, then its last token alone
    (pinned as a prompt's: ``feed.PIN_AFTER``)."""
    model = model_for()
    caches = model.make_cache()
    rng, spans = np.random.default_rng(0), []
    for k in range(3):
        words = rng.integers(0, 190, 5 + 3 * k).tolist()
        start = caches[0].offset
        list(generate_step(mx.array(turn(words)), model, prompt_cache=caches, max_tokens=4,
                           prefill_step_size=STEP))
        spans.append(start)
        held = pinned(caches)
        words_at = set(range(start + len(TEMPLATE), start + len(TEMPLATE) + len(words)))
        assert words_at <= held  # the user's words
        if k == 0:
            assert set(range(start, start + len(turn(words)))) <= held  # the first template
        else:  # the template again: only the prompt's last token (fed alone) is pinned
            template_at = set(range(start, start + len(TEMPLATE)))
            end_at = set(range(start + len(turn(words)) - len(END), start + len(turn(words))))
            assert not template_at & held and (end_at & held) == {max(end_at)}
    off = patch_model(tiny_llama(2), KVCacheConfig(
        method="streaming_llm", morphkv_budget=24, morphkv_n_sink=2, morphkv_window=4,
        pin="prompt"))
    c2 = off.make_cache()
    list(generate_step(mx.array(turn([1, 2, 3])), off, prompt_cache=c2, max_tokens=4))
    list(generate_step(mx.array(turn([4, 5, 6])), off, prompt_cache=c2, max_tokens=4))
    assert set(range(c2[0].offset - 4 - 12, c2[0].offset - 4)) <= pinned(c2)  # off: all


def served(model, prompts: list, caches: list) -> tuple[list, dict]:
    """(uids, uid -> finished response) of ``prompts`` run together through BatchGenerator."""
    gen = BatchGenerator(model, max_tokens=4, prefill_step_size=STEP)
    uids, done = gen.insert(prompts, max_tokens=[4] * len(prompts), caches=caches), {}
    for _ in range(100):
        done.update({r.uid: r for r in gen.next_generated() if r.finish_reason})
        if len(done) == len(prompts):
            break
    gen.close()
    return uids, done


def test_the_server_prompt_cache_and_batch_rows_keep_each_rows_memory(tmp_path):
    """A first turn of two rows through BatchGenerator, each kept in the server's prompt cache,
    fetched back (a deepcopy), a second turn merged into a batch: the template is heard."""
    from morphkv.server.run import bounded_prompt_cache

    model = model_for()
    first = [turn([5, 6, 7, 8]), turn([9, 10, 11, 12, 13, 14])]
    uids, finished = served(model, first, [None, None])
    kept = bounded_prompt_cache(10, 10**9)
    for uid in uids:
        kept.insert_cache("m", finished[uid].all_tokens, finished[uid].prompt_cache)
    history = finished[uids[1]].all_tokens
    second = turn([40, 41, 42])
    back, rest = kept.fetch_nearest_cache("m", history + second)
    assert rest == second and back[0].pins.heard.size
    at = back[0].offset
    _, done = served(model, [rest, turn([50, 51])], [back, None])
    caches = min(done.values(), key=lambda r: r.uid).prompt_cache
    held = pinned(caches)
    assert {at + 6, at + 7, at + 8} <= held and not set(range(at, at + 6)) & held
    fresh = max(done.values(), key=lambda r: r.uid).prompt_cache  # a new row: all pinned
    assert set(range(len(turn([50, 51])))) <= pinned(fresh)
    copied = copy.deepcopy(caches)
    np.testing.assert_array_equal(copied[0].pins.heard, caches[0].pins.heard)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    np.testing.assert_array_equal(loaded[0].pins.heard, caches[0].pins.heard)
    state, before = list(caches[0].state), caches[0].pins.heard.copy()
    for bad in ("[-1]", "[4294967296]", '"x"', "[1.5]", str(list(range(300)))):
        header = state[0].replace('"heard": [', f'"heard": {bad}, "was": [')
        with pytest.raises(ValueError, match="'heard' must be"):
            caches[0].state = [header, *state[1:]]
        np.testing.assert_array_equal(caches[0].pins.heard, before)  # nothing lost


def test_the_vote_counts_only_what_the_prompt_pins_and_the_bound_counts_the_memory(monkeypatch):
    from morphkv.core import vote

    incoming, trim_row = [], vote.trim_row
    monkeypatch.setattr(vote, "trim_row", lambda cs, i, n, seen: incoming.append(n) or
                        trim_row(cs, i, n, seen))
    counted, held = {}, {}
    for n in (4, 0):
        model = model_for(n, pin_rank="vote", morphkv_budget=64, pin_replies=4)
        held[n] = caches = model.make_cache()
        for k in range(6):
            incoming.clear()
            list(generate_step(mx.array(turn(range(10 * k, 10 * k + 8))), model,
                               prompt_cache=caches, max_tokens=3, prefill_step_size=STEP))
        counted[n] = sum(incoming)  # the last turn's prefill, in pieces for the vote
    # the template again (6 + the 5 END tokens before the last, fed alone) is not pinned
    assert counted[0] - counted[4] == 6 + 5
    on, off = held[4], held[0]
    assert on[0].pins.heard.size and not any(c.pins.heard.size for c in on[1:] + off)
    assert all(c.nbytes <= c.nbytes_bound for c in on)
    assert on[1].nbytes_bound - off[1].nbytes_bound == repeats.HEARD * 4  # counted in each


def test_pin_repeats_is_validated_and_named_by_the_flag_and_the_server():
    from morphkv.runtime.cache_flags import describe

    for bad in (1, 17, -2, 2.0, True):
        with pytest.raises(ValueError, match="pin_repeats must be 0"):
            KVCacheConfig(pin_repeats=bad).validate()
    from morphkv.server.memory import engine_and_pins

    on = KVCacheConfig(pin="prompt", pin_repeats=4).validate()
    assert "pin-repeats=4" in describe(on)
    assert "less runs of 4 tokens an earlier prompt" in engine_and_pins(on)  # serve's first line
    assert "less runs" not in engine_and_pins(KVCacheConfig(pin="prompt").validate())
