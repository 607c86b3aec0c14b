"""A multi-token update for rules that read no attention: every eviction decided first, then ONE
attention with a visibility mask.

Recency (``streaming_llm``, ``sliding_window``) and KeyDiff rank the stored tokens by position
or key geometry alone, pinned tokens too (``pin_rank`` ``"rule"`` or ``"keydiff"``). So the
evictions a chunk's tokens cause, one token (or block) at a time, can be decided before any of
its queries attend: ``schedule`` replays the per-token rule on the host over the "virtual"
rows [stored rows; the chunk's rows] (positions and pins; the keys' unit vectors only once an
eviction must rank keys), and records, for each virtual row, after which chunk token it went.
Query i then sees exactly the rows arrived by i and not evicted before it (``visible``): what
token-by-token feeding stores when i arrives, so the output and the kept set are those of the
per-token rule (``tests/reference.py``), with one attention instead of one per token, and one
gather of the kept rows into the storage instead of a row move per token. A pinned prompt
over the budget (every pick a key-ranked pinned one) is replayed many tokens per pass
(``core.pinned_replay``), with the same picks.

Costs one host read per chunk and layer (the stored positions; the keys when a key-ranked pick
is due); a decode step never comes here (``DevicePath._feed``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import pinned_replay, quant, storage, unpinned
from .attention import attend

NEVER = np.iinfo(np.int32).max
LAST = np.iinfo(np.int64).max  # a position above every stored one


def fits(engine) -> bool:
    """Can this engine's chunks be scheduled (``KVCacheConfig.scheduled``)?"""
    rank = engine.config.pin_rank != "keydiff-span"
    return engine.rule.scheduled is not None and rank and engine.value_norms is None


class _KeyGeometry:
    """KeyDiff's scores over the virtual rows (``rules.KeyDiff``: 1 - cos(unit key, unit mean
    of the stored unit keys)), the mean kept as a running sum over the alive rows."""

    def __init__(self, keys: np.ndarray, alive: np.ndarray) -> None:
        keys = keys.astype(np.float64)
        norm = np.sqrt((keys * keys).sum(axis=-1, keepdims=True))
        self.units = keys / np.where(norm > 0, norm, 1.0)
        self.total = (self.units * alive[..., None]).sum(axis=1)

    def add(self, rows, index, sign: float) -> None:
        self.total += sign * self.units[rows, index]

    def scores(self) -> np.ndarray:
        """Lower goes first: -(unit key . sum of unit keys), the order of 1 - cos(key,
        anchor) (the anchor's norm is one positive factor per row)."""
        return -np.matmul(self.units, self.total[..., None])[..., 0]


def _lowest(score, mask, pos) -> np.ndarray:
    """(R,) per row the lowest (score, position) among ``mask`` (ties to the oldest)."""
    if score is pos:  # recency: the oldest
        return np.where(mask, pos, LAST).argmin(axis=1)
    key = np.where(mask, score, np.inf)
    return np.where(mask & (key <= key.min(axis=1, keepdims=True)), pos, LAST).argmin(axis=1)


def _pick(score, mask, pos, count: int, out: list) -> np.ndarray:
    """Per row, ``count`` lowest (score, position) among ``mask``; picks appended to ``out``
    as (R,) index arrays; returns the mask without them."""
    for _ in range(count):
        victim = _lowest(score, mask, pos)
        out.append(victim)
        mask = mask.copy()
        mask[np.arange(len(victim)), victim] = False
    return mask


def _evictions(n0: int, k: int, block: int, budget: int) -> list[int]:
    """The chunk tokens after whose arrival an eviction runs (the last token's waits): which
    tokens go does not change when."""
    out, slots = [], n0
    for i in range(k - 1):
        slots += 1
        if slots > budget:
            out.append(i)
            slots -= block
    return out


def _oldest_first(c, pos, free, t0: int, n0: int, k: int, evicted) -> int:
    """Recency's leading evictions at once: while every row's ``block`` oldest free (unsunk,
    unpinned) virtual rows not yet taken are candidates (old enough), the per-token loop takes
    exactly those, in position order. Marks them in ``evicted`` and returns the chunk token
    the loop resumes at (``k``: every eviction done)."""
    at = _evictions(n0, k, c.block, c.budget)
    if not at:
        return 0
    R, block = pos.shape[0], c.block
    count = int(free.sum(axis=1).min()) // block  # evictions every row has free rows for
    e = min(len(at), count)
    if e == 0:  # (a pinned prompt: no free row at all)
        return at[0]
    order = np.argsort(np.where(free, pos, LAST), axis=1, kind="stable")
    queue = order[:, : e * block].reshape(R, e, block)
    when = np.asarray(at[:e])
    old = np.take_along_axis(pos, queue[:, :, -1], axis=1) <= t0 + when - c.recent  # (R, e)
    ok = old.all(axis=0)
    e = e if ok.all() else int(np.argmin(ok))
    if e:
        np.put_along_axis(evicted, queue[:, :e].reshape(R, -1),
                          np.repeat(when[:e], block)[None].astype(np.int32), axis=1)
    return at[e] if e < len(at) else k


def schedule(engine, pos0: np.ndarray, k: int, keys) -> tuple[np.ndarray, np.ndarray, int]:
    """Replay the per-token rule over k new tokens at an engine holding the rows ``pos0``
    (R, n0) (no eviction due). Returns (evicted_at (R, n0 + k): the chunk token after whose
    attention each virtual row went, NEVER if kept; kept (R, m) virtual indices, ascending;
    m), and leaves ``engine.due`` as token-by-token feeding would (the last token's
    eviction waits for the next update). ``keys()``: (R, n0 + k, D) float host keys, read
    only when a pick ranks keys."""
    c = engine.config
    R, n0 = pos0.shape
    N, t0, block, budget = n0 + k, engine.seen, c.block, c.budget
    pos = np.concatenate([pos0.astype(np.int64),
                          np.broadcast_to(np.arange(t0, t0 + k, dtype=np.int64), (R, k))], 1)
    pins = engine.pins if engine.pins is not None and len(engine.pins) else None
    pinned = pins.host(pos) if pins is not None else np.zeros((R, N), bool)
    alive = np.zeros((R, N), bool)
    unsunk, unpinned = pos >= c.n_sink, ~pinned
    evicted = np.full((R, N), NEVER, np.int32)
    by_keys = engine.rule.scheduled == "keydiff"
    geometry = None
    rows = np.arange(R)
    start = 0 if by_keys else _oldest_first(c, pos, unsunk & unpinned, t0, n0, k, evicted)
    alive[:, : n0 + start] = True
    alive[evicted != NEVER] = False
    slots = n0 + start - int((evicted != NEVER).sum()) // R  # (the evictions before start)
    free0 = unsunk & unpinned
    has_free = bool(free0.any())  # False: no unpinned candidate ever
    replay = not by_keys and block == 1 and c.pins_by_keys  # pinned_replay's setting
    i = start - 1
    while i < k - 1:
        i += 1
        alive[:, n0 + i] = True
        if geometry is not None:
            geometry.add(rows, n0 + i, 1.0)
        slots += 1
        if slots <= budget or i == k - 1:  # the last token's eviction waits (``due``)
            continue
        # every candidate left, alive or to come, pinned: the replay decides many at once
        if replay and geometry is not None and not (
                has_free and (free0 & (evicted == NEVER)).any()):
            done = pinned_replay.advance(geometry, alive, evicted, pos, unsunk, i, k, n0, t0,
                                         c.recent)
            if done:  # tokens i .. i + done - 1 each evicted one row (block 1)
                slots -= 1
                i += done - 1
                continue
        cand = alive & unsunk & (pos <= t0 + i - c.recent)
        if has_free or block > 1:
            free = cand & unpinned
            n_free = np.minimum(free.sum(axis=1), block)
            short = (n_free < block).any()
        else:  # every candidate is pinned (a pinned prompt): each pick is a pinned one
            short = True
        if geometry is None and (by_keys or (short and c.pins_by_keys)):
            geometry = _KeyGeometry(keys(), alive)
        kd = None if geometry is None or not (by_keys or short) else geometry.scores()
        score = kd if by_keys else pos
        picks: list = []
        if not short:
            _pick(score, free, pos, block, picks)
        elif block == 1:  # rows without an unpinned candidate take their lowest pinned one
            pinned_score = kd if c.pins_by_keys else score
            picks = [np.where(n_free > 0, _lowest(score, free, pos),
                              _lowest(pinned_score, cand & pinned, pos)) if has_free
                     else _lowest(pinned_score, cand, pos)]
        else:  # a row with too few unpinned candidates takes its lowest pinned ones too
            pinned_score = kd if c.pins_by_keys else score
            per_row = []
            for r in range(R):
                mine: list = []
                _pick(score[r : r + 1], free[r : r + 1], pos[r : r + 1], int(n_free[r]), mine)
                _pick(pinned_score[r : r + 1], (cand & pinned)[r : r + 1], pos[r : r + 1],
                      block - int(n_free[r]), mine)
                per_row.append([int(m[0]) for m in mine])
            picks = list(np.array(per_row).T)
        for victim in picks:
            alive[rows, victim] = False
            evicted[rows, victim] = i
            if geometry is not None:
                geometry.add(rows, victim, -1.0)
        slots -= block
    engine.due = slots > budget and engine.rule.evicts
    kept = np.argsort(~alive, axis=1, kind="stable")[:, :slots]
    return evicted, kept, slots


def visible(evicted: np.ndarray, n0: int, k: int, B: int) -> mx.array:
    """(B, H, k, n0 + k) bool: chunk token i sees the virtual rows arrived by i (stored rows,
    and chunk rows j <= i) and not evicted before it (evicted at i or later)."""
    R, N = evicted.shape
    i = mx.arange(k, dtype=mx.int32)[:, None]
    at = mx.array(np.concatenate([np.full(n0, -1), np.arange(k)]).astype(np.int32))
    seen = (at[None, None, :] <= i[None]) & (mx.array(evicted)[:, None, :] >= i[None])
    return seen.reshape(B, R // B, k, N)  # built on the device: (R, k, N) is large


def feed(engine, held, new, queries, sinks, quantized, decide=None):
    """One chunk of ``engine``'s rows (no eviction due): ``held`` the (keys, values) storages
    of its rows (``budget + 1`` slots, the first ``engine.slots`` live), ``new`` the chunk's
    as stored. Returns (the attention output for ``queries`` or None, the storages after):
    kept stored rows stay in their slots, kept new rows fill the evicted ones and the free
    slots above (no copy of the storage and the chunk joined). One host read: the positions.
    ``decide``: the scheduler (default ``schedule``; ``core.proxy_schedule.schedule`` for keys
    as proxy queries, which reads the keys too)."""
    n0, k = engine.slots, quant.dims(new[0])[2]
    pos0 = np.array(engine.positions[:, :n0])
    old = [storage.fetch(x, n0) for x in held]

    def keys():
        parts = [storage.floats(x, engine.config).astype(mx.float32)
                 for x in ([old[0]] if n0 else []) + [new[0]]]
        return np.concatenate([np.array(x).reshape(engine.rows, -1, x.shape[-1])
                               for x in parts], axis=1)

    evicted, kept, m = (decide or schedule)(engine, pos0, k, keys)
    out = None
    if queries is not None:
        sources = [old[0], new[0]] if n0 else [new[0]], [old[1], new[1]] if n0 else [new[1]]
        out, _ = attend(queries, *sources, n0 + k, engine.scale, sinks, quantized,
                        valid=visible(evicted, n0, k, engine.B))
    (old_dst, old_src), (dst, src) = placement(kept, n0, m)
    B, H = engine.B, engine.H

    def put(x, y, dst, src):
        d, g = (mx.array(a.reshape(B, H, -1, 1)) for a in (dst, src))
        return quant.apply(lambda p, n: mx.put_along_axis(
            p, d, mx.take_along_axis(n, g, axis=2), axis=2), x, y)

    positions = engine.positions
    if old_dst is not None:  # kept stored rows above slot m move down first
        held = [put(x, x, old_dst, old_src) for x in held]
        positions = mx.put_along_axis(positions, mx.array(old_dst), mx.take_along_axis(
            positions, mx.array(old_src), axis=1), axis=1)
    held = [put(x, y, dst, src) for x, y in zip(held, new, strict=True)]
    engine.positions = mx.put_along_axis(positions, mx.array(dst),
                                         mx.array(src + engine.seen), axis=1)
    engine.seen, engine.slots = engine.seen + k, m
    if engine.unpinned is not None:
        at = np.concatenate([pos0, np.broadcast_to(np.arange(engine.seen - k, engine.seen),
                                                   (engine.rows, k))], axis=1)
        engine.unpinned = unpinned.of_kept(np.take_along_axis(at, kept, 1), engine.pins)
    return out, held


def placement(kept: np.ndarray, n0: int, m: int):
    """Row moves that leave the kept virtual rows ``kept`` (R, m) in slots [0, m): kept
    stored rows below m stay; the holes below m (evicted slots, free slots) take the kept
    stored rows above m, then the kept chunk rows. Returns ((dst, src) of the stored rows, or
    (None, None) when none moves; (dst, src chunk row) of the chunk's), each (R, J) int32;
    a row with fewer than J pairs repeats its last one (stored rows with none: slot 0 onto
    itself; chunk rows with none: the unused slot m, then m <= n0 <= budget)."""
    R = kept.shape[0]
    olds, news = [], []
    for r in range(R):
        mine = kept[r]
        stay = mine[mine < min(n0, m)]
        holes = np.setdiff1d(np.arange(m), stay)  # ascending
        up = np.sort(mine[(mine >= m) & (mine < n0)])
        fresh = np.sort(mine[mine >= n0]) - n0
        olds.append((holes[: len(up)], up))
        news.append((holes[len(up) :], fresh))
    return _pad(olds, 0, 0), _pad(news, m, 0)


def _pad(pairs: list, dst0: int, src0: int):
    J = max(len(d) for d, _ in pairs)
    if J == 0:
        return None, None
    dst = np.full((len(pairs), J), dst0, np.int32)
    src = np.full((len(pairs), J), src0, np.int32)
    for r, (d, s) in enumerate(pairs):
        if len(d):
            dst[r] = np.r_[d, np.full(J - len(d), d[-1])]
            src[r] = np.r_[s, np.full(J - len(s), s[-1])]
    return dst, src
