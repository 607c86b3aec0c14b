"""A chunk of per-token proxy evictions decided in one host loop (keys as proxy queries).

For a window rule scored by keys as proxy queries (``device_proxy.fits``), the evictions a
chunk causes token by token depend on the keys alone, so, as for recency
(``core.device_schedule``), they can be decided before anything attends: one read of the
stored and the chunk's keys, then ``replay`` (NumPy, every KV head in step) runs the
per-token rule over the virtual rows [stored rows; the chunk's rows], in blocks of ``BLOCK``
tokens. Per block, one float32 BLAS product gives the logits of its tokens and of the
W - 1 before them (the window's queries) against every column (the virtual rows alive at
the block's start, then the block's tokens, in position order: the first of equal scores
is the oldest), and one ``exp`` each row's ``exp(l - top)`` (``top`` its largest logit).
At a token the window's rows are W consecutive rows of those (the window is protected, so
its tokens are known by position), and their softmax over the columns alive now is those
rows normalized by their sums over ``alive``: an eviction costs two products (the sums, the
weighted mean) and an argmin. Exps and scores are float32 when no two logits can lie more
than ``EXP_RANGE`` apart (bounded by the largest key norm), else float64 (float32 would
flush the smallest exps to zero). Returns what ``device_schedule.schedule`` returns, so the
same visibility mask, attention and gather finish the chunk.
"""

from __future__ import annotations

import math

import numpy as np

from .device_schedule import NEVER

FUSIONS = {"mean": 0, "max": 1, "newest": 2}
BLOCK = 64  # chunk tokens per BLAS product (and per compaction of the columns)
EXP_RANGE = 64.0  # logits at most this far apart: exps in float32 (no underflow), else float64


def replay(own, valid, cols, p, n: int, i0: int, k_all: int, evicted, t0: int, c,
           fusion: int) -> np.ndarray:
    """Chunk tokens [i0, i0 + k) of every head. ``own`` (R, W - 1 + k, n + k): the rows
    ``exp(l - top)`` of the W - 1 tokens before the block and of the block's k tokens
    against the block's columns ``cols`` (R, n + k) (virtual rows at positions ``p``,
    ascending; the first n alive); ``valid`` (R, W - 1 + k) the rows that hold a token (at
    a position >= 0). Records each token's eviction in ``evicted`` (``k_all``: the chunk's
    tokens; its last one leaves its eviction due); returns the virtual rows alive after, in
    column order."""
    R, C = cols.shape
    k = C - n
    W = own.shape[1] - k + 1
    heads = np.arange(R)
    t = t0 + i0 + np.arange(k)
    finite = bool(np.isfinite(own).all())
    # every score finite (float32 exps of logits < EXP_RANGE apart do not underflow: no row
    # sums to 0) and a column free (more alive than sinks and recent tokens): no NaN check
    sure = finite and own.dtype == np.float32 and c.budget >= c.n_sink + c.recent
    filled = valid.all(axis=0)  # the window's oldest row holds a token: every row does
    # the column whose position turns unprotected at each token (p = t - recent), if any:
    # alive, as it was protected until now; else the spare column C
    due = np.stack([np.searchsorted(p[r], t - c.recent) for r in range(R)]).clip(0, C - 1)
    due_ok = (np.take_along_axis(p, due, 1) == t - c.recent) & (t - c.recent >= c.n_sink)
    opens = (np.where(due_ok, due, C) + (C + 1) * heads[:, None]).T  # (k, R) flat
    alive = np.zeros((R, C), own.dtype)
    alive[:, :n] = 1.0
    # 0 where a column may go, inf where it may not (dead, a sink, recent, not yet come)
    shut = np.full((R, C + 1), np.inf, own.dtype)
    shut[:, :n][(p[:, :n] >= c.n_sink) & (p[:, :n] < t[0] - c.recent)] = 0.0
    flat_shut, flat_alive, free = shut.reshape(-1), alive.reshape(-1), shut[:, :C]
    at_shut, at_alive = heads * (C + 1), heads * C
    victims = np.full((k, R), -1, np.int64)
    count, inv_w = n, 1.0 / W
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for a in range(k):
            count += 1
            flat_alive[at_alive + n + a] = 1.0
            flat_shut[opens[a]] = 0.0
            if count <= c.budget or i0 + a == k_all - 1:
                continue
            rows = own[:, a : a + W]  # the window: the token and the W - 1 before it
            if not finite:  # NaN times a dead column's 0 is no 0
                rows = np.where(alive[:, None] > 0, rows, 0.0)
            sums = np.matmul(rows, alive[..., None])[..., 0]  # (R, W) over the alive columns
            if fusion == 0 and filled[a]:  # the mean of the rows' softmax: one product
                score = np.matmul((inv_w / sums)[:, None], rows)[:, 0]
            else:
                score = _score(rows, sums, valid[:, a : a + W], fusion)
            key = score + free
            victim = key.argmin(axis=1)  # columns ascend by position: ties go to the oldest
            if not sure and not math.isfinite(np.add.reduce(np.minimum.reduce(key, axis=1))):
                victim = _nonfinite(score, free, p)
            victims[a] = victim
            flat_shut[at_shut + victim] = np.inf
            flat_alive[at_alive + victim] = 0.0
            count -= 1
    done = np.flatnonzero(victims[:, 0] >= 0)
    evicted[heads[:, None], np.take_along_axis(cols, victims[done].T, 1)] = i0 + done
    keep = np.argsort(alive == 0, axis=1, kind="stable")[:, :count]
    return np.take_along_axis(cols, keep, 1)


def _score(rows, sums, valid, fusion: int):
    """(R, C) the rule's scores from the window's rows (R, W, C) and their sums (R, W); rows
    that hold no token (before position 0) count for nothing."""
    if fusion == 2:  # the newest row alone
        return rows[:, -1] / sums[:, -1:]
    if fusion == 0:
        weight = valid / np.where(valid, sums, 1.0) / valid.sum(axis=1, keepdims=True)
        return np.matmul(weight[:, None], rows)[:, 0]
    P = rows / np.where(valid, sums, 1.0)[..., None]
    return np.fmax.reduce(np.where(valid[..., None], P, 0.0), axis=1, initial=0.0)


def _nonfinite(score, shut, p) -> np.ndarray:
    """(R,) the victim when some key is not finite: NaN ranks +inf, as the step's does;
    among the lowest, the oldest."""
    key = np.where(shut == 0, np.where(np.isnan(score), np.inf, score), np.nan)
    best = np.nanmin(key, axis=1, keepdims=True)
    return np.where(key == best, p, np.iinfo(np.int64).max).argmin(axis=1)


def _queries(pos0, live, t0: int, k: int, W: int):
    """Every window query of the chunk, positions t0 - W + 1 .. t0 + k - 1: its virtual row
    (R, W - 1 + k) (a stored row for positions before t0) and whether it holds a token."""
    R, n0 = pos0.shape
    q = np.arange(t0 - W + 1, t0 + k)
    row = np.broadcast_to(n0 + q - t0, (R, q.size)).copy()
    valid = np.broadcast_to(q >= t0, (R, q.size)).copy()
    if n0:
        stored = np.take_along_axis(pos0, live, 1).astype(np.int64)  # ascending
        at = np.stack([np.searchsorted(stored[r], q) for r in range(R)]).clip(0, n0 - 1)
        held = (np.take_along_axis(stored, at, 1) == q) & (q < t0)
        row[held] = np.take_along_axis(live, at, 1)[held]
        valid |= held
    row[~valid] = 0
    return row, valid


def schedule(engine, pos0: np.ndarray, k: int, keys) -> tuple[np.ndarray, np.ndarray, int]:
    """``device_schedule.schedule`` for the proxy window rules: (evicted (R, n0 + k), kept
    (R, m) virtual indices ascending, m); sets ``engine.due``. ``keys()``: (R, n0 + k, D)."""
    c = engine.config
    R, n0 = pos0.shape
    t0, W = engine.seen, c.window
    rule = engine.rule
    fusion = 2 if rule.window_rows == "newest" else FUSIONS[getattr(rule, "fusion", "mean")]
    K = np.ascontiguousarray(keys(), dtype=np.float32)
    Ks = K * np.float32(engine.scale)  # queries' side of every logit
    # every logit lies within scale * max |k|^2 of 0: float32 exps unless that is wide
    wide = 2 * engine.scale * float(np.einsum("rnd,rnd->rn", K, K).max(initial=0.0))
    dtype = np.float32 if wide <= EXP_RANGE else np.float64
    pos = np.concatenate([pos0.astype(np.int64),
                          np.broadcast_to(np.arange(t0, t0 + k, dtype=np.int64), (R, k))], 1)
    evicted = np.full((R, n0 + k), NEVER, np.int32)
    heads = np.arange(R)[:, None]
    live = np.argsort(pos0, axis=1)  # the stored rows in position order
    qrow, qvalid = _queries(pos0, live, t0, k, W)
    for i0 in range(0, k, BLOCK):
        i1 = min(k, i0 + BLOCK)
        cols = np.concatenate([live, np.broadcast_to(np.arange(n0 + i0, n0 + i1),
                                                     (R, i1 - i0))], 1)
        valid = qvalid[:, i0 : i1 + W - 1]
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite keys: NaN scores
            own = (Ks[heads, qrow[:, i0 : i1 + W - 1]] @ K[heads, cols].transpose(0, 2, 1))
            own = own.astype(dtype, copy=False)
            top = np.fmax.reduce(own, axis=2, initial=-np.inf)  # NaN is no maximum
            np.exp(np.subtract(own, top[..., None], out=own), out=own)
        own[~valid] = 0.0
        live = replay(own, valid, cols, pos[heads, cols], live.shape[1], i0, k, evicted, t0, c,
                      fusion)
    alive = np.zeros((R, n0 + k), np.bool_)
    alive[heads, live] = True
    slots = live.shape[1]
    engine.due = slots > c.budget
    kept = np.argsort(~alive, axis=1, kind="stable")[:, :slots]
    return evicted, kept, slots
