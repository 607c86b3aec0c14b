"""A chunk of per-token proxy evictions decided in one host loop (keys as proxy queries).

For a window rule scored by keys as proxy queries (``device_proxy.fits``), the evictions a
chunk causes token by token depend on the keys alone, so, as for recency
(``core.device_schedule``), they can be decided before anything attends: one read of the
stored and the chunk's keys, then ``_Window.replay`` (NumPy, every KV head in step) runs the
per-token rule over the virtual
rows [stored rows; the chunk's rows] with the window's proxy attention kept incrementally
(``core.device_proxy``'s formulation: per token one row in, one column in; each window row's
``exp(l - M)`` with its running maximum ``M``, normalized afresh at every eviction). The dot
products come from float32 BLAS products, blockwise; whatever follows from the keys alone
(each token's own row, its column in the other rows, the maxima) is done per block, so a
token costs a few NumPy calls. Exps and scores are float32 when no two logits can lie more
than ``EXP_RANGE`` apart (bounded by the largest key norm), else float64 (float32 would
flush the smallest exps to zero).
Returns what ``device_schedule.schedule`` returns, so the same visibility mask, attention and
gather finish the chunk.
"""

from __future__ import annotations

import math

import numpy as np

from .device_schedule import NEVER

FUSIONS = {"mean": 0, "max": 1, "newest": 2}
BLOCK = 64  # chunk tokens per BLAS product (and per compaction of the columns)
EXP_RANGE = 64.0  # logits at most this far apart: exps in float32 (no underflow), else float64


class _Window:
    """The window's proxy attention of every KV head, kept incrementally (see the module
    docstring), over the columns of one block of chunk tokens: [the virtual rows alive at the
    block's start; the block's tokens], in position order (so the first of equal scores is
    the oldest). ``E`` (R, W, cols) each window row's ``exp(l - M)`` by column (zero in dead
    columns), ``M`` (R, W) its running maximum, ``valid`` (R, W) rows that hold a token,
    ``row`` (R, W) each row's column. Every head takes its tokens in step: the alive count
    is the same in every head (each eviction takes one token)."""

    def __init__(self, R: int, W: int, n: int, dtype) -> None:
        self.M = np.zeros((R, W), dtype)  # finite: exp(-inf - M) is 0 in rows not yet held
        self.valid = np.zeros((R, W), np.bool_)
        self.row = np.zeros((R, W), np.int64)
        self.E = np.zeros((R, W, n), dtype)
        self.filled = False  # every window row holds a token

    def replay(self, G, cols, p, i0: int, k_all: int, evicted, t0: int, c,
               fusion: int) -> np.ndarray:
        """Chunk tokens [i0, i0 + k) of every head, the block's ``cols`` (R, n + k) virtual
        rows (their positions ``p``, ascending) of which the first n are alive, ``G``
        (R, k, n + k) the tokens' float32 logits against them (``k_all``: the chunk's
        tokens; its last one leaves its eviction due); each token's eviction recorded in
        ``evicted``. Returns the virtual rows alive after, in column order.

        What follows from the keys alone is done for the whole block first (``_block``);
        per token there is left: its column and its own row into ``E``, the scores, the
        victim."""
        R, k, C = G.shape
        n, W = C - k, self.M.shape[1]
        t = t0 + i0 + np.arange(k)
        heads = np.arange(R)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            own, column, grow, factor, created = self._block(G, n, t)
            finite = bool(np.isfinite(own).all())
            # the column whose position turns unprotected at each token (p = t - recent), if
            # any: alive, as it was protected until now; else the spare column C
            due = np.stack([np.searchsorted(p[r], t - c.recent) for r in range(R)]).clip(0, C - 1)
            due_ok = (np.take_along_axis(p, due, 1) == t - c.recent) & (t - c.recent >= c.n_sink)
            opens = (np.where(due_ok, due, C) + (C + 1) * heads[:, None]).T  # (k, R) flat
            alive = np.ones((R, C), self.E.dtype)  # 0 for evicted columns
            E = np.zeros((R, W, C), self.E.dtype)
            E[:, :, :n] = self.E
            # 0 where a column may go, inf where it may not (dead, a sink, recent)
            shut = np.full((R, C + 1), np.inf, self.E.dtype)
            shut[:, :C][(p >= c.n_sink) & (p < t[0] - c.recent)] = 0.0
            flat_shut, flat_E, flat_alive = shut.reshape(-1), E.reshape(-1), alive.reshape(-1)
            key_shut = shut[:, :C]
            at_E = (heads[:, None] * W + np.arange(W)) * C  # (R, W) flat row starts in E
            at_shut, at_alive = heads * (C + 1), heads * C
            victims = np.full((k, R), -1, np.int64)
            valid0, invW, count = self.valid, 1.0 / W, n
            for a in range(k):
                new, r = n + a, t[a] % W
                count += 1
                flat_shut[opens[a]] = 0.0
                if grow[a]:
                    E *= factor[:, a, :, None]
                E[:, :, new] = column[:, a]  # the token's column in the other rows
                if finite:  # its own row: evicted columns zero (later ones are)
                    np.multiply(own[:, a, : new + 1], alive[:, : new + 1], out=E[:, r, : new + 1])
                else:
                    E[:, r, : new + 1] = np.where(alive[:, : new + 1] > 0, own[:, a, : new + 1], 0)
                if count <= c.budget or i0 + a == k_all - 1:
                    continue
                if not self.filled:
                    self.valid = valid0 | created[a]
                    self.filled = bool(self.valid.all())
                if self.filled and fusion == 0:  # the mean of the rows' softmax: one product
                    score = np.matmul((invW / np.add.reduce(E, axis=2))[:, None, :], E)[:, 0]
                    key = np.add(score, key_shut, out=score)
                    victim = key.argmin(axis=1)  # columns ascend by position: ties go to the oldest
                    if not math.isfinite(np.add.reduce(np.minimum.reduce(key, axis=1))):
                        victim = self._victim(E, key_shut, p, t[a], fusion, heads)
                else:
                    victim = self._victim(E, key_shut, p, t[a], fusion, heads)
                victims[a] = victim
                flat_E[at_E + victim[:, None]] = 0.0
                flat_shut[at_shut + victim] = np.inf
                flat_alive[at_alive + victim] = 0.0
                count -= 1
        self.valid = valid0 | created[-1]
        done = np.flatnonzero(victims[:, 0] >= 0)
        evicted[heads[:, None], np.take_along_axis(cols, victims[done].T, 1)] = i0 + done
        keep = np.argsort(alive == 0, axis=1, kind="stable")[:, :count]
        self.E = np.take_along_axis(E, keep[:, None, :], 2)
        where = np.full((R, C), -1, np.int64)
        where[heads[:, None], keep] = np.arange(count)
        q = t[-1] - (t[-1] - np.arange(W)) % W  # each row's newest token by the block's end
        self.row = where[heads[:, None], np.where(q >= t[0], n + q - t[0], self.row)]
        return np.take_along_axis(cols, keep, 1)

    def _block(self, G, n: int, t):
        """The block's tokens' own rows ``exp(l - top)`` (R, k, C) (``top`` their maximum over
        every column: any bound of the alive ones is a valid shift) and, per token, its
        column in every window row ``exp(lv - M)`` (R, k, W) (``lv`` its logit as the newest
        key of the row's token: window tokens are protected, so known by position), with
        each row's running maximum ``M`` (it restarts at the row's token's own ``top``):
        ``grow`` (k,) the tokens at which a maximum grows, ``factor`` (R, k, W) the rescale
        then, ``created`` (k, W) the rows that held a token by then. Sets ``self.M``."""
        R, k, C = G.shape
        W = self.M.shape[1]
        G = G.astype(self.E.dtype)
        top = np.fmax.reduce(G, axis=2, initial=-np.inf)  # NaN is no maximum
        own = np.exp(G - top[..., None])
        q = t[:, None] - 1 - (t[:, None] - 1 - np.arange(W)) % W  # (k, W): row w's token
        inside = q >= t[0]
        at = np.where(inside[None], n + q - t[0], self.row[:, None, :])  # (R, k, W)
        lv = np.take_along_axis(G, at, 2)
        mine = q == t[:, None] - W  # the row the token takes (its token leaves)
        lv[~(inside[None] | self.valid[:, None, :]) | mine[None]] = -np.inf
        z = np.where(mine[None], top[..., None], lv)
        since = (t[:, None] - np.arange(W)) % W  # tokens since the row's token came (k, W)
        z = np.concatenate([np.broadcast_to(self.M[:, None], (R, W, W)), z], 1)  # from k - W
        M = z[:, W:]
        for j in range(1, W):  # the running maximum since each row's token
            M = np.where(since[None] >= j, np.fmax(M, z[:, W - j : W - j + k]), M)
        before = np.concatenate([self.M[:, None], M[:, :-1]], 1)
        grown = lv > before
        factor = np.exp(np.where(grown, before - M, 0.0))
        self.M = M[:, -1].copy()
        created = np.logical_or.accumulate(mine, axis=0)
        return own, np.exp(lv - M), grown.any(axis=(0, 2)), factor, created

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
    # every logit lies within scale * max |k|^2 of 0: float32 exps unless that is wide
    wide = 2 * engine.scale * float(np.einsum("rnd,rnd->rn", K, K).max(initial=0.0))
    win = _Window(R, W, n0, np.float32 if wide <= EXP_RANGE else np.float64)
    live = np.argsort(pos0, axis=1)  # the stored rows in position order
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
        G = Ks[:, n0 + i0 : n0 + i1] @ K[heads, cols].transpose(0, 2, 1)
        live = win.replay(G, cols, pos[heads, cols], i0, k, evicted, t0, c, fusion)
    alive[heads, live] = True
    slots = live.shape[1]
    engine.due = slots > c.budget
    kept = np.argsort(~alive, axis=1, kind="stable")[:, :slots]
    return evicted, kept, slots
