"""A chunk of per-token proxy evictions decided in one host loop (keys as proxy queries).

For a window rule scored by keys as proxy queries (``device_proxy.fits``), the evictions a
chunk causes token by token depend on the keys alone, so, as for recency
(``core.device_schedule``), they can be decided before anything attends: one read of the
stored and the chunk's keys, then ``_Window.replay`` (NumPy, every KV head in step) runs the
per-token rule over the virtual
rows [stored rows; the chunk's rows] with the window's proxy attention kept incrementally
(``core.device_proxy``'s formulation: per token one row in, one column in; each window row's
``exp(l - M)`` with its running maximum ``M``, normalized afresh at every eviction). The dot
products come from float32 BLAS products, blockwise; the softmax and the scores are float64.
Returns what ``device_schedule.schedule`` returns, so the same visibility mask, attention and
gather finish the chunk.
"""

from __future__ import annotations

import math

import numpy as np

from .device_schedule import NEVER

FUSIONS = {"mean": 0, "max": 1, "newest": 2}
BLOCK = 64  # chunk tokens per BLAS product (and per compaction of the columns)


class _Window:
    """The window's proxy attention of every KV head, kept incrementally (see the module
    docstring), over the columns of one block of chunk tokens: [the virtual rows alive at the
    block's start; the block's tokens], in position order (so the first of equal scores is
    the oldest). ``E`` (R, W, cols) each window row's ``exp(l - M)`` by column (zero in dead
    columns), ``M`` (R, W) its running maximum, ``valid`` (R, W) rows that hold a token,
    ``row`` (R, W) each row's column. Every head takes its tokens in step: the alive count
    is the same in every head (each eviction takes one token)."""

    def __init__(self, R: int, W: int) -> None:
        self.M = np.full((R, W), -np.inf)
        self.valid = np.zeros((R, W), np.bool_)
        self.row = np.zeros((R, W), np.int64)
        self.E = np.zeros((R, W, 0))
        self.filled = False  # every window row holds a token

    def replay(self, G, cols, p, i0: int, k_all: int, evicted, t0: int, c,
               fusion: int) -> np.ndarray:
        """Chunk tokens [i0, i0 + k) of every head, the block's ``cols`` (R, n + k) virtual
        rows (their positions ``p``, ascending) of which the first n are alive, ``G``
        (R, k, n + k) the tokens' float32 logits against them (``k_all``: the chunk's
        tokens; its last one leaves its eviction due); each token's eviction recorded in
        ``evicted``. Returns the virtual rows alive after, in column order."""
        R, k, C = G.shape
        n = C - k
        heads = np.arange(R)
        G = G.astype(np.float64)
        t = t0 + i0 + np.arange(k)
        # the column whose position turns unprotected at each token (p = t - recent), if any
        due = np.stack([np.searchsorted(p[r], t - c.recent) for r in range(R)]).clip(0, C - 1)
        due_ok = (np.take_along_axis(p, due, 1) == t - c.recent) & (t - c.recent >= c.n_sink)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            alive = np.zeros((R, C), np.bool_)
            alive[:, :n] = True
            E = np.zeros((R, self.M.shape[1], C))
            E[:, :, :n] = self.E
            # 0 where a column may go, inf where it may not (dead, a sink, recent)
            shut = np.where(alive & (p >= c.n_sink) & (p < t[0] - c.recent), 0.0, np.inf)
            count = n
            for a in range(k):
                alive[:, n + a] = True
                count += 1
                opened = due[:, a][due_ok[:, a]]
                shut[heads[due_ok[:, a]], opened] = np.where(
                    alive[heads[due_ok[:, a]], opened], 0.0, np.inf)
                self._token(G[:, a], alive, E, n + a, t[a], heads)
                if count <= c.budget or i0 + a == k_all - 1:
                    continue
                victim = self._victim(E, shut, p, t[a], fusion, heads)
                evicted[heads, cols[heads, victim]] = i0 + a
                alive[heads, victim] = False
                E[heads, :, victim] = 0.0
                shut[heads, victim] = np.inf
                count -= 1
        keep = np.argsort(~alive, axis=1, kind="stable")[:, :count]
        self.E = np.take_along_axis(E, keep[:, None, :], 2)
        where = np.full((R, C), -1, np.int64)
        where[heads[:, None], keep] = np.arange(count)
        self.row = where[heads[:, None], self.row]
        return np.take_along_axis(cols, keep, 1)

    def _token(self, Ga, alive, E, new: int, t: int, heads) -> None:
        """The token at position t (column ``new``, ``Ga`` (R, cols) its float64 logits): its
        column in every other window row, and its own row (the alive columns)."""
        M, valid, W = self.M, self.valid, self.M.shape[1]
        r = t % W  # the token's own row (the token leaving the window had it)
        others = valid.copy()
        others[:, r] = False
        lv = np.where(others, Ga[heads[:, None], self.row], -np.inf)
        grown = lv > M
        if grown.any():
            E *= np.exp(np.where(grown, M - lv, 0.0))[..., None]
            M[grown] = lv[grown]
        E[:, :, new] = np.where(others, np.exp(lv - M), 0.0)
        g = np.where(alive, Ga, -np.inf)  # dead columns: zero in ``E``
        M[:, r] = top = np.fmax.reduce(g, axis=1, initial=-np.inf)  # NaN is no maximum
        own = E[:, r]
        np.subtract(g, top[:, None], out=own)
        np.exp(own, out=own)
        valid[:, r], self.row[:, r] = True, new
        self.filled = self.filled or bool(valid.all())

    def _victim(self, E, shut, p, t: int, fusion: int, heads) -> np.ndarray:
        """(R,) the column to evict: the lowest (score, position) one that may go."""
        valid, r = self.valid, t % self.M.shape[1]
        if fusion == 2:  # the newest row alone
            score = E[:, r] / E[:, r].sum(axis=1, keepdims=True)
        elif fusion == 0:  # the mean of the valid rows' softmax: one product
            if self.filled:  # every row holds a token (all but the chunk's first tokens)
                weight = 1.0 / E.sum(axis=2) / valid.shape[1]
            else:
                weight = valid / np.where(valid, E.sum(axis=2), 1.0) / valid.sum(axis=1)[:, None]
            score = np.matmul(weight[:, None, :], E)[:, 0]
        else:
            P = E / np.where(valid, E.sum(axis=2), 1.0)[..., None]
            score = np.fmax.reduce(np.where(valid[..., None], P, 0.0), axis=1, initial=0.0)
        key = score + shut
        victim = key.argmin(axis=1)  # columns ascend by position: ties go to the oldest
        if math.isfinite(key[heads, victim].sum()):
            return victim
        free = shut == 0  # non-finite keys: NaN ranks +inf, as the step's does
        key = np.where(free, np.where(np.isnan(score), np.inf, score), np.nan)
        best = np.nanmin(key, axis=1, keepdims=True)
        return np.where(key == best, p, np.iinfo(np.int64).max).argmin(axis=1)


def schedule(engine, pos0: np.ndarray, k: int, keys) -> tuple[np.ndarray, np.ndarray, int]:
    """``device_schedule.schedule`` for the proxy window rules: (evicted (R, n0 + k), kept
    (R, m) virtual indices ascending, m); sets ``engine.due``. ``keys()``: (R, n0 + k, D)."""
    c = engine.config
    R, n0 = pos0.shape
    N, t0, W = n0 + k, engine.seen, c.window
    rule = engine.rule
    fusion = 2 if rule.window_rows == "newest" else FUSIONS[getattr(rule, "fusion", "mean")]
    K = np.ascontiguousarray(keys(), dtype=np.float32)
    Ks = K * np.float32(engine.scale)  # queries' side of every logit
    pos = np.concatenate([pos0.astype(np.int64),
                          np.broadcast_to(np.arange(t0, t0 + k, dtype=np.int64), (R, k))], 1)
    evicted = np.full((R, N), NEVER, np.int32)
    alive = np.zeros((R, N), np.bool_)
    win = _Window(R, W)
    live = np.argsort(pos0, axis=1)  # the stored rows in position order
    if n0:
        win.E = np.zeros((R, W, n0))
    for r in range(R):
        if n0:
            Kr = K[r, live[r]]
            L0 = (Ks[r, live[r, -W:]] @ Kr.T).astype(np.float64)  # the newest W: (w, n0)
            for idx, j in enumerate(range(max(n0 - W, 0), n0)):
                w = int(pos0[r, live[r, j]]) % W
                win.M[r, w] = L0[idx].max()
                win.E[r, w] = np.exp(L0[idx] - win.M[r, w])
                win.valid[r, w], win.row[r, w] = True, j
    heads = np.arange(R)[:, None]
    for i0 in range(0, k, BLOCK):
        i1 = min(k, i0 + BLOCK)
        cols = np.concatenate([live, np.broadcast_to(np.arange(n0 + i0, n0 + i1),
                                                     (R, i1 - i0))], 1)
        G = Ks[:, n0 + i0 : n0 + i1] @ np.take_along_axis(K, cols[..., None], 1).transpose(0, 2, 1)
        live = win.replay(G, cols, pos[heads, cols], i0, k, evicted, t0, c, fusion)
    alive[heads, live] = True
    slots = live.shape[1]
    engine.due = slots > c.budget
    kept = np.argsort(~alive, axis=1, kind="stable")[:, :slots]
    return evicted, kept, slots
