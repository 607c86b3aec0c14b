"""``pin_rank="vote"``: one ranking of the pinned tokens over every layer and KV head.

Real mlx_lm ``generate_step`` (mlx_lm.chat's loop: one prompt cache, each turn feeds its new
tokens) and ``BatchGenerator`` (the server's loop) on tiny random-weight llama models whose
pinned turns overflow the budget: with the vote every layer and head keeps the same pinned
positions (each head's own KeyDiff does not), within ``vote.room`` and ``MAX_RUNS`` ranges;
the kept tokens are the top of the averaged KeyDiff score recounted here in NumPy; batch rows
equal single runs; ``unpatch_model`` gives the model its class back.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, generate_step

from morphkv import KVCacheConfig, patch_model, unpatch_model
from morphkv.core import vote
from morphkv.eval.models import tiny_llama
from tests.test_batch import assert_same_cache, prompts_of

STEP = 64  # one prefill chunk a turn: the vote runs before it
TURNS = [6, 11, 4, 13, 9, 12, 7]


def model_for(rank="vote", **extra):
    config = KVCacheConfig(method="streaming_llm", morphkv_budget=40, morphkv_n_sink=2,
                           morphkv_window=4, pin="prompt", pin_rank=rank, pin_replies=6,
                           scoring="attention", **extra)
    return patch_model(tiny_llama(2, head_dim=64), config)


def chat(model, turns, caches=None, replies=5):
    caches = model.make_cache() if caches is None else caches
    for turn in turns:
        list(generate_step(mx.array(turn), model, prompt_cache=caches, max_tokens=replies,
                           prefill_step_size=STEP))
    return caches


def pinned_held(caches) -> list:
    """Per layer and KV head: the held positions that are pinned."""
    return [sorted(set(h.tolist()) & set(c.pins.positions().tolist()))
            for c in caches for kept in c.kept_positions for h in kept]


def test_choose_keeps_the_best_scored_and_the_newest_in_few_runs():
    pinned = np.array([1, 1, 1, 0, 1, 1, 1, 1, 0, 1], bool)
    score = np.array([9, 1, 8, 0, 2, 7, 3, 6, 0, 0], float)
    stay = vote.choose(pinned, score, keep=4)
    assert stay.tolist() == [1, 0, 1, 0, 0, 1, 0, 0, 0, 1]  # 9, 8, 7 and the newest
    joined = vote.choose(pinned, score, keep=4, max_runs=2)  # a gap of pinned tokens fills
    assert joined.sum() <= 4 and len(vote.runs(np.arange(10), joined)[0]) <= 2
    assert joined[-1] and not joined[pinned == 0].any()  # never pins an unpinned token


def join_one_at_a_time(stay, pinned, max_runs):
    """``vote.join`` as first written: one gap filled (the shortest of pinned tokens only, the
    earliest of equals) or, with none left, the shortest run dropped, until few enough runs."""
    stay = stay.copy()
    while True:
        edges = np.flatnonzero(np.diff(np.r_[0, stay.astype(np.int8), 0]))
        begin, end = edges[::2], edges[1::2]
        if begin.size <= max_runs:
            return stay
        gaps = [(e, b) for e, b in zip(end[:-1], begin[1:], strict=True) if pinned[e:b].all()]
        if gaps:
            e, b = min(gaps, key=lambda g: g[1] - g[0])
            stay[e:b] = True
        else:
            shortest = int(np.argmin(end - begin))
            stay[begin[shortest] : end[shortest]] = False


def test_join_chooses_at_once_what_one_at_a_time_chooses():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        n = int(rng.integers(1, 60))
        pinned = rng.random(n) < rng.random()
        stay = (rng.random(n) < rng.random()) & pinned
        runs = int(rng.integers(1, 6))
        assert (vote.join(stay, pinned, runs) == join_one_at_a_time(stay, pinned, runs)).all()


@pytest.mark.parametrize(("bits", "rank"), [(None, "vote"), (8, "vote"), (8, "vote-span")])
def test_the_vote_keeps_one_pinned_set_in_every_layer_and_head(bits, rank):
    extra = {} if bits is None else dict(kv_bits=bits, kv_group_size=32)
    turns = prompts_of(TURNS, seed=3)
    by_head = pinned_held(chat(model_for("keydiff", **extra), turns))
    assert any(h != by_head[0] for h in by_head)  # each head its own: they differ here
    caches = chat(model_for(rank, **extra), turns)
    held = pinned_held(caches)
    assert all(h == held[0] for h in held)  # one ranking: the same in every layer and head
    room = vote.room(caches[0].config)
    assert len([p for p in held[0] if p >= 2]) <= room + TURNS[-1] + 2
    assert len(caches[0].pins.starts) <= vote.MAX_RUNS + 2


@pytest.mark.parametrize("rank", ["vote", "vote-span"])
def test_the_kept_pinned_tokens_are_the_top_of_the_averaged_keydiff(rank):
    """"vote-span": each pinned token scores the best of the pinned tokens among the 5 held
    tokens centred on it, recounted here one token at a time."""
    model, turns = model_for(rank), prompts_of(TURNS, seed=3)
    caches = chat(model, turns[:-1])
    last = turns[-1]
    seen, c = caches[0].offset, caches[0]
    keep = vote.room(c.config) - len(last) - c.reply_due(0, seen)
    views = [vote.held_row(x, 0) for x in caches]
    held = np.unique(np.concatenate([p.ravel() for p, _ in views]))
    score = {int(p): [] for p in held}
    for positions, keys in views:  # the NumPy recount: 1 - cos(unit key, mean unit key)
        for row_p, row_k in zip(positions, keys, strict=True):
            unit = row_k / np.linalg.norm(row_k, axis=-1, keepdims=True)
            mean = unit.mean(0) / np.linalg.norm(unit.mean(0))
            for p, u in zip(row_p, unit, strict=True):
                score[int(p)].append(1 - float(u @ mean))
    pinned = [int(p) for p in held if p >= 2 and p in set(c.pins.positions().tolist())]
    assert len(pinned) > keep  # the vote must drop some
    mean = {p: np.mean(score[p]) for p in pinned}
    if rank == "vote-span":
        order = [int(p) for p in held]
        mean = {p: max(mean[q] for q in order[max(order.index(p) - 2, 0) : order.index(p) + 3]
                       if q in mean) for p in pinned}
    best = sorted(pinned, key=lambda p: -mean[p])[:keep] + [max(pinned)]
    chat(model, [last], caches, replies=1)
    after = set(caches[0].pins.positions().tolist())
    assert set(best) <= after  # fragmented into more runs than allowed it could keep fewer
    assert not (set(pinned) - set(best)) & after


def test_batch_rows_equal_single_runs_and_unpatch_restores_the_class():
    model = model_for()
    first, second = prompts_of([30, 41], seed=5), prompts_of([9, 14], seed=6)
    gen = BatchGenerator(model, max_tokens=6, prefill_step_size=STEP)
    uids = gen.insert(first, max_tokens=[6, 6])
    caches = dict(finished(gen, len(first)))
    gen = BatchGenerator(model, max_tokens=6, prefill_step_size=STEP)
    again = gen.insert(second, max_tokens=[6, 6], caches=[caches[u] for u in uids])
    done = dict(finished(gen, len(second)))
    for uid, a, b in zip(again, first, second, strict=True):
        reference = chat(model, [a, b], replies=6)
        assert [c.pins.ranges() for c in done[uid]] == [c.pins.ranges() for c in reference]
        assert_same_cache(done[uid], reference)
    cls = type(model)
    assert unpatch_model(model) is model and type(model) is not cls
    assert type(model).__name__ == "Model" and not hasattr(type(model), "morphkv_watched")


def finished(gen, n):
    out = {}
    for _ in range(400):
        for r in gen.next_generated():
            if r.finish_reason is not None:
                out[r.uid] = r.prompt_cache
        if len(out) == n:
            break
    gen.close()
    return out.items()


def test_the_vote_runs_only_where_its_room_holds_twice_the_pinned_reply():
    """At small budgets (room < 2 x pin_replies) each layer ranks its own pins, and the cache
    line and the server's start-up line say so; at Qwen's 1.5 MiB (216 tokens) it votes."""
    from morphkv import recommended
    from morphkv.runtime.cache_flags import describe
    from morphkv.server.memory import engine_and_pins

    small, large = recommended(48, pin_rank="vote"), recommended(216, pin_rank="vote")
    assert (vote.votes(small), vote.votes(large)) == (False, True)
    assert vote.room(large) >= 2 * large.pin_replies > vote.room(small)
    assert "keydiff per layer" in describe(small) and "keydiff per layer" not in describe(large)
    assert "each layer ranks its own" in engine_and_pins(small)
    assert "one ranking over all layers" in engine_and_pins(large)


def test_a_chunk_longer_than_the_room_is_voted_in_pieces_as_mlx_lm_would_cut_it():
    """A turn of 45 tokens (room 31): the whole chunk at once is cut into pieces of
    ``vote.piece`` (a vote before each), so every layer and head keeps one pinned set, and the
    result equals mlx_lm cutting the prompt into those pieces itself (``prefill_step_size``)."""
    turns = prompts_of(TURNS[:4] + [45], seed=4)
    model = model_for()
    caches = chat(model, turns)
    size = vote.piece(caches, 64)
    assert 2 <= size < 45 and vote.pieces(10, 4) == [(0, 4), (4, 8), (8, 10)]
    held = pinned_held(caches)
    assert all(h == held[0] for h in held)
    cut = model.make_cache()
    for turn in turns:
        list(generate_step(mx.array(turn), model, prompt_cache=cut, max_tokens=5,
                           prefill_step_size=size))
    assert [c.pins.ranges() for c in cut] == [c.pins.ranges() for c in caches]
    assert_same_cache(cut, caches)


def test_the_pieces_no_vote_needs_run_as_one_with_the_same_result(monkeypatch):
    """Turns whose pins stay within the room (31) are not cut, and a longer one runs its
    leading pieces as one up to where a vote can run (``vote.plan``); the caches equal those of
    the same chat cut into every piece (each of those votes returning unread)."""
    turns = prompts_of([12, 9, 40, 8], seed=5)
    model = model_for()
    fresh = model.make_cache()
    size = vote.piece(fresh, 45)
    assert vote.plan(fresh, 12, vote.piece(fresh, 12)) == [(0, 12)]
    assert vote.plan(fresh, 45, size) == [(0, 28), *vote.pieces(45, size)[4:]] and size == 7
    joined = chat(model, turns)
    assert len(vote.plan(joined, 8, vote.piece(joined, 8))) == 2  # pins near the room now
    monkeypatch.setattr(vote, "plan", lambda caches, C, size: vote.pieces(C, size))
    cut = chat(model, turns)
    assert [c.pins.ranges() for c in cut] == [c.pins.ranges() for c in joined]
    assert_same_cache(cut, joined)
