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
gather of the kept rows into the storage instead of a row move per token.

Costs one host read per chunk and layer (the stored positions; the keys when a key-ranked pick
is due); a decode step never comes here (``DevicePath._feed``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .rules import KeyDiff, Recency

NEVER = np.iinfo(np.int32).max


def fits(engine) -> bool:
    """Can this engine's chunks be scheduled (its rule and pin ranking read no attention)?"""
    rule, rank = engine.rule, engine.config.pin_rank
    return (type(rule) in SCORES and rank in ("rule", "keydiff")
            and engine.running is None and engine.value_norms is None and engine.ring is None)


SCORES = {Recency: "recency", KeyDiff: "keydiff"}
for _cls in list(SCORES):  # SlidingWindow: Recency without sinks (its n_sink is 0)
    for _sub in _cls.__subclasses__():
        SCORES[_sub] = SCORES[_cls]


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
        norm = np.sqrt((self.total * self.total).sum(axis=-1, keepdims=True))
        anchor = self.total / np.where(norm > 0, norm, 1.0)
        return np.maximum(1.0 - np.matmul(self.units, anchor[..., None])[..., 0], 0.0)


def _pick(score, mask, pos, count: int, out: list) -> np.ndarray:
    """Per row, ``count`` lowest (score, position) among ``mask``; picks appended to ``out``
    as (R,) index arrays; returns the mask without them."""
    for _ in range(count):
        key = np.where(mask, score, np.inf)
        low = key.min(axis=1, keepdims=True)
        victim = np.where(mask & (key <= low), pos, np.iinfo(np.int64).max).argmin(axis=1)
        out.append(victim)
        mask = mask.copy()
        mask[np.arange(len(victim)), victim] = False
    return mask


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
    alive[:, :n0] = True
    evicted = np.full((R, N), NEVER, np.int32)
    by_keys = SCORES[type(engine.rule)] == "keydiff"
    geometry = None
    rows = np.arange(R)
    slots = n0
    for i in range(k):
        alive[:, n0 + i] = True
        if geometry is not None:
            geometry.add(rows, n0 + i, 1.0)
        slots += 1
        if slots <= budget or i == k - 1:  # the last token's eviction waits (``due``)
            continue
        cand = alive & (pos >= c.n_sink) & (pos <= t0 + i - c.recent)
        free = cand & ~pinned
        n_free = np.minimum(free.sum(axis=1), block)
        short = (n_free < block).any()
        if geometry is None and (by_keys or (short and c.pin_rank == "keydiff")):
            geometry = _KeyGeometry(keys(), alive)
        kd = None if geometry is None else geometry.scores()
        score = kd if by_keys else pos
        picks: list = []
        if not short:
            _pick(score, free, pos, block, picks)
        else:  # a row with too few unpinned candidates takes its lowest pinned ones too
            pinned_score = kd if c.pin_rank == "keydiff" else score
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
    i = np.arange(k)[:, None]
    arrived = np.concatenate([np.full(n0, -1), np.arange(k)])[None, :] <= i  # (k, N)
    seen = arrived[None] & (evicted[:, None, :] >= i[None])
    return mx.array(seen.reshape(B, R // B, k, N))
