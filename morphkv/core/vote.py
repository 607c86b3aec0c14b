"""``pin_rank="vote"``: one ranking of the pinned tokens, shared by every layer.

Once a long chat's pinned tokens (its user turns) alone overflow the budget, each layer's cache
ranks them by itself (``pin_rank="keydiff"``: each KV head its own KeyDiff), so a name or a
number said once loses a different sub-token in each head and comes back cut ("Reykjavia"). A
probe found a fact value whole in the top 30% of the user's tokens in 62% of (layer, head)
cells by each head's own ranking, and in 9 of 9 values by one ranking averaged over all layers
and heads (docs/recall.md, ``docs/figures/pin_heads_probe.py``).

``trim`` is that one ranking, run by the model's forward pass (``morphkv.mlxlm.forward``)
before a chunk of several tokens (a prefill) reaches the layers: where a row's held pinned
tokens, with those the chunk will pin, would leave less than ``room`` for the rest, every
layer's pinned keys are read once (one host sync), each scored as KeyDiff does (1 - cos of the
unit key with its head's mean unit key), averaged per position over every layer and KV head
holding it, and the lowest are unpinned in every layer alike; the rule then evicts them as any
unpinned token (recency: the oldest first). The newest pinned token stays pinned (it marks where
the model's last reply starts: ``pin_replies``). Pins stay pins: merged, extracted, copied and
saved rows keep the result. A chunk that alone exceeds the room leaves the layers to rank by
themselves (as ``"keydiff"``). The new pins are at most ``MAX_RUNS`` ranges: where the choice
is more fragmented, the cheapest gaps of pinned tokens between kept runs stay pinned too.

``pin_rank="vote-span"`` votes the same way with each pinned token's averaged score replaced by
the largest of the pinned ones among the ``PIN_SPAN`` (5) held tokens centred on it (SnapKV's
pooling, in position order): KeyDiff ranks function words low, so a plain vote keeps "Hobart"
and "Tromso" of "I've just moved from Hobart to Tromso" and drops the words that say which is
the new one (docs/recall.md, round 14's probe); pooled, the words around a kept word stay too.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import quant, storage
from .config import VOTES
from .feed import PIN_AFTER
from .pins import MAX_RANGES, true_runs
from .rules import PIN_SPAN
from .unpinned import Unpinned

MAX_RUNS = MAX_RANGES - 8  # ranges a vote leaves (room for the turns pinned before the next)


def room(config) -> int:
    """Pinned tokens a row may hold after a prompt arrives and still have every eviction of its
    reply take an unpinned token: the budget less the sinks, the protected recent tokens, one
    block and the one-token updates pinned after a prompt."""
    return config.budget - config.n_sink - config.recent - config.block - PIN_AFTER


def votes(config) -> bool:
    """Does this setting vote? Only where the room holds twice the longest reply it pins (a due
    reply and at least as much of the history): at smaller budgets (48 tokens of the embedded
    model) a vote would cut the earlier turns to a few tokens, so each layer ranks its own."""
    return config.pin_rank in VOTES and room(config) >= 2 * max(config.pin_replies, 1)


def per_layer(config) -> bool:
    """A vote setting whose (resolved) budget is too small for one ranking: each layer ranks
    its own pinned tokens, as ``"keydiff"`` (what the cache and start-up lines say)."""
    return config.pin_rank in VOTES and bool(config.budget) and not votes(config)


def voting(caches: list) -> list:
    """The morphkv caches among ``caches`` whose setting votes."""
    return [c for c in caches if hasattr(c, "engines") and votes(c.config)]


def piece(caches: list, C: int) -> int:
    """Columns a forward pass of ``C`` columns is cut into (``C``: not cut): where a vote
    runs, a quarter of its room (``plan`` joins the pieces no vote needs), so each piece's vote
    keeps at least the room less a quarter and the due reply. A whole chunk at once (mlx_lm's
    prefill step: up to 2,048; the evals' 256) would leave it ``room - C``: nothing at all past
    the room (each layer then ranks alone)."""
    if C < 4:
        return C
    those = voting(caches)
    return max(2, min(C, room(those[0].config) // 4)) if those else C


def plan(caches: list, C: int, size: int) -> list[tuple[int, int]]:
    """[start, end) column ranges a forward pass of ``C`` columns runs as: ``pieces(C, size)``,
    the leading pieces before which no vote can run joined into one. A vote before the piece
    ending at column ``b`` can run only where a row's pinned tokens (all it ever pinned: an
    upper bound on those held), its due reply and its columns up to ``b`` pass the room; below
    that, every vote would return before reading a key, so joining changes nothing but the
    number of forward passes (the same logits and caches; ``docs/figures/whole_chunk_probe.py``:
    a 150-token turn into Qwen2.5-0.5B's memory preset whole in 0.67x the time of four
    pieces)."""
    cut = pieces(C, size)
    cache = next(iter(voting(caches)), None)
    if cache is None or len(cut) == 1:
        return cut
    starts, counts = cache.spans(C)
    limit, rows = room(cache.config), []
    for i, (s, n) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True)):
        engine = cache.engines[i]  # None before a row's first update: nothing due yet
        due = 0 if engine is None else cache.reply_due(i, engine.seen)
        if n:
            rows.append((s, n, len(cache.pins_of(i)) + due))
    free = sum(all(base + min(max(b - s, 0), n) <= limit for s, n, base in rows)
               for _, b in cut)  # the bound grows with b: the free pieces lead
    return [(0, cut[free - 1][1]), *cut[free:]] if free > 1 else cut


def pieces(C: int, size: int) -> list[tuple[int, int]]:
    """[start, end) column ranges of ``size`` (the last one shorter): mlx_lm's batches pad
    prompts on the right, so each row is cut where it would be cut alone (a one-column piece
    is a prompt's all the same: ``Feed.prompt``)."""
    starts = list(range(0, C, size))
    return list(zip(starts, starts[1:] + [C], strict=True))


def trim(caches: list, C: int, prompt: bool = False) -> None:
    """Before a forward pass of ``C`` columns: the vote in every row that needs one (a decode
    step, C = 1 and not a ``prompt`` piece, returns before looking at any cache)."""
    if C < 2 and not prompt:
        return
    those = voting(caches)
    if not those or getattr(those[0], "_held", None) is not None:
        return
    first = those[0]
    _, counts = first.spans(C)
    for i, n in enumerate(counts):
        engine = first.engines[i]
        if n and engine is not None:
            incoming = first.pinned_count(i, int(n), C) + first.reply_due(i, engine.seen)
            trim_row(those, i, incoming, engine.seen)


def trim_row(caches: list, i: int, incoming: int, seen: int) -> bool:
    """Row ``i``'s vote, ``incoming`` tokens to be pinned next; returns whether pins changed."""
    keep = room(caches[0].config) - incoming
    if keep <= 0:  # the chunk (with its due reply) alone fills the room: each layer ranks
        return False
    pins = caches[0].pins_of(i)
    if len(pins) <= keep:  # an upper bound on the held pinned tokens: nothing to read
        return False
    for c in caches:
        settle(c, i)
    views = [held_row(c, i) for c in caches]
    held = np.unique(np.concatenate([p.ravel() for p, _ in views]))
    pinned = pins.host(held)
    if (pinned & (held >= caches[0].config.n_sink)).sum() <= keep:
        return False
    total, cells = np.zeros(held.size), np.zeros(held.size)
    for positions, keys in views:
        idx = np.searchsorted(held, positions)
        np.add.at(total, idx, keydiff(keys))
        np.add.at(cells, idx, 1)
    sink = held < caches[0].config.n_sink  # protected anyway: pinned, never counted
    score = total / np.maximum(cells, 1)
    if caches[0].config.pin_rank == "vote-span":
        score = pooled(score, pinned & ~sink, PIN_SPAN)
    stay = choose(pinned & ~sink, score, keep) | (pinned & sink)
    starts, ends = runs(held, stay)
    ahead = pins.ends > seen  # pinned ahead of the tokens seen: kept as they are
    starts = np.concatenate([starts, np.maximum(pins.starts[ahead], seen)])
    ends = np.concatenate([ends, pins.ends[ahead]])
    freed = held[pinned & ~stay]
    for cache, (positions, _) in zip(caches, views, strict=True):
        row_pins, engine = cache.pins_of(i), cache.engines[i]
        row_pins.starts, row_pins.ends, row_pins._device = starts.copy(), ends.copy(), None
        if engine.unpinned is not None:  # recency's mirror: the freed positions, if every
            every = all(np.isin(freed, r).all() for r in positions)  # head holds them
            engine.unpinned = Unpinned(sorted(set(engine.unpinned.positions)
                                              | set(freed.tolist()))) if every else None
    return True


def keydiff(keys: np.ndarray) -> np.ndarray:
    """(R, n) KeyDiff scores of (R, n, D) keys: 1 - cos(unit key, mean unit key of its row)."""
    unit = keys / np.maximum(np.linalg.norm(keys, axis=-1, keepdims=True), 1e-6)
    mean = unit.mean(axis=1, keepdims=True)
    mean /= np.maximum(np.linalg.norm(mean, axis=-1, keepdims=True), 1e-6)
    return 1.0 - (unit * mean).sum(-1)


def pooled(score: np.ndarray, among: np.ndarray, width: int) -> np.ndarray:
    """``score`` with each token of ``among`` given the largest score among the ``among`` tokens
    of the ``width`` held tokens centred on it (tokens not ``among`` neither lend nor take)."""
    half = width // 2
    lent = np.pad(np.where(among, score, -np.inf), half, constant_values=-np.inf)
    best = np.lib.stride_tricks.sliding_window_view(lent, width).max(axis=1)
    return np.where(among, best, score)


def choose(pinned: np.ndarray, score: np.ndarray, keep: int, max_runs: int = MAX_RUNS):
    """Which of the held tokens (in position order) stay pinned: the ``keep`` best-scored
    pinned ones and the newest pinned one, in at most ``max_runs`` runs of consecutive held
    tokens (fewer kept where gaps of pinned tokens must be filled to join runs)."""
    idx = np.flatnonzero(pinned)
    if idx.size == 0:
        return np.zeros(pinned.size, np.bool_)
    k = keep
    while True:
        stay = np.zeros(pinned.size, np.bool_)
        best = idx[np.argsort(-score[idx], kind="stable")[: max(k, 0)]]
        stay[best] = True
        stay[idx[-1]] = True
        stay = join(stay, pinned, max_runs)
        if stay.sum() <= max(keep, 1) or k <= 0:
            return stay
        k -= int(stay.sum()) - keep


def join(stay: np.ndarray, pinned: np.ndarray, max_runs: int) -> np.ndarray:
    """``stay`` in at most ``max_runs`` runs: the shortest gaps made only of pinned tokens are
    filled first (ties: the earliest); past those, the runs holding the fewest tokens go. Filling
    a gap or dropping a run leaves the other gaps and runs as they were, and once no gap of
    pinned tokens is left none appears (a dropped run joins a gap holding an unpinned token, or
    ends the row), so both are chosen at once by a stable sort."""
    stay = stay.copy()
    begin, end = true_runs(stay)
    excess = begin.size - max_runs
    if excess <= 0:
        return stay
    e, b = end[:-1], begin[1:]  # the gaps between runs: [e, b)
    unpinned = np.r_[0, np.cumsum(~pinned.astype(bool))]
    fill = np.flatnonzero(unpinned[b] == unpinned[e])  # gaps of pinned tokens only
    fill = fill[np.argsort(b[fill] - e[fill], kind="stable")][:excess]
    for g in fill:
        stay[e[g] : b[g]] = True
    if fill.size == excess:
        return stay
    begin, end = true_runs(stay)
    for r in np.argsort(end - begin, kind="stable")[: begin.size - max_runs]:
        stay[begin[r] : end[r]] = False
    return stay


def runs(held: np.ndarray, stay: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) position ranges of the runs of ``stay`` among the held positions: a run
    spans the positions between its held tokens too (none of them held: never seen again)."""
    begin, end = true_runs(stay)
    return held[begin].astype(np.int64), held[end - 1].astype(np.int64) + 1


def settle(cache, i: int) -> None:
    """Row ``i``'s due eviction runs now, under the pins it was due with (as a single cache's
    ``state`` does between mlx_lm's prefill steps), so the vote reads a settled row however the
    prompt was cut and whichever cache holds the row."""
    if hasattr(cache, "caches"):
        settle(cache.caches[i], 0)
    elif getattr(cache, "_arrays", None) is not None:
        if cache.engines[i].due:
            cache.evict_rows([i])
    else:
        cache._flush()


def held_row(cache, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Row ``i``'s stored positions (R, n) and float keys (R, n, D): a single cache, a batch on
    the MLX engine (``DeviceBatchCache``) or a row-wise batch (``BatchMorphKVCache``)."""
    if hasattr(cache, "caches"):
        return held_row(cache.caches[i], 0)
    n = cache.engines[i].slots
    arrays = getattr(cache, "_arrays", None)
    if arrays is None:  # one engine, every row of the cache
        positions, keys = cache.engines[i].stored_positions, cache.keys
    else:
        H = cache._H
        positions = arrays["positions"][i * H : (i + 1) * H, :n]
        keys = quant.apply(lambda x: x[i : i + 1], cache.keys)
    floats = storage.floats(storage.fetch(keys, n), cache.config)
    return (np.array(positions).astype(np.int64),
            np.array(floats.astype(mx.float32)).reshape(-1, n, floats.shape[-1]))
