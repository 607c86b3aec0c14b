"""A chunk of per-token proxy evictions decided in one compiled host loop (keys as proxy queries).

For a window rule scored by keys as proxy queries (``device_proxy.fits``), the evictions a
chunk causes token by token depend on the keys alone, so, as for recency
(``core.device_schedule``), they can be decided before anything attends: one read of the
stored and the chunk's keys, then ``_replay`` (numba) runs the per-token rule over the virtual
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
from numba import njit

from .device_schedule import NEVER

FUSIONS = {"mean": 0, "max": 1, "newest": 2}
BLOCK = 256  # chunk tokens per BLAS product


@njit(cache=True, nogil=True, error_model="numpy")
def _replay(G, col, i0, row_vi, E, M, valid, live, n_live, pos, evicted, n0, t0, W, budget,
            recent, n_sink, fusion):
    """Chunk tokens [i0, i0 + len(G)) of one KV head: ``G`` (rows, cols) their logits against
    the virtual rows that can be alive meanwhile (virtual row j is column ``col[j]``);
    ``live[:n_live]`` the alive virtual rows by slot; ``E``/``M`` (W, slots)/(W,) the window
    rows by slot (the token at position p in row p % W), ``row_vi`` (W,) each row's virtual
    row. An evicted slot takes the last one. Returns the alive count after."""
    k_all = evicted.shape[0] - n0
    g = np.zeros(live.shape[0])
    score = np.zeros(live.shape[0])
    for a in range(G.shape[0]):
        i = i0 + a
        v = n0 + i
        t = t0 + i
        new = n_live
        live[new] = v
        n_live += 1
        r = t % W  # the token's own row (the token leaving the window had it)
        for w in range(W):  # the new token's column in the other window rows
            if valid[w] and w != r:
                lv = G[a, col[row_vi[w]]]
                if lv > M[w]:
                    f = math.exp(M[w] - lv)
                    for s in range(new):
                        E[w, s] *= f
                    M[w] = lv
                E[w, new] = math.exp(lv - M[w])
        top = -np.inf
        for s in range(n_live):
            g[s] = G[a, col[live[s]]]
            top = max(top, g[s])
        for s in range(n_live):
            E[r, s] = math.exp(g[s] - top)
        M[r], valid[r], row_vi[r] = top, True, v
        if n_live <= budget or i == k_all - 1:
            continue
        count = 0
        score[:n_live] = 0.0
        for w in range(W):
            if valid[w] and (fusion != 2 or w == r):
                count += 1
                z = 0.0
                for s in range(n_live):
                    z += E[w, s]
                for s in range(n_live):
                    x = E[w, s] / z
                    score[s] = max(score[s], x) if fusion == 1 else score[s] + x
        best, best_pos, victim = np.inf, np.iinfo(np.int64).max, -1  # (score, position)
        for s in range(n_live):
            p = pos[live[s]]
            if p < n_sink or p > t - recent:
                continue
            x = score[s] / count if fusion == 0 else score[s]
            if not x <= np.inf:  # NaN (non-finite keys): ranks as +inf, as the step's does
                x = np.inf
            if x < best or (x == best and p < best_pos):
                best, best_pos, victim = x, p, s
        if victim >= 0:
            last = n_live - 1
            evicted[live[victim]] = i
            live[victim] = live[last]
            for w in range(W):
                E[w, victim] = E[w, last]
            n_live = last
    return n_live


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
    m = np.zeros(R, np.int64)
    for r in range(R):
        E, M = np.zeros((W, max(N, c.budget + 2))), np.full(W, -np.inf)
        valid, row_vi = np.zeros(W, np.bool_), np.zeros(W, np.int64)
        live = np.zeros(max(N, c.budget + 2), np.int64)
        live[:n0] = np.arange(n0)
        n_live = n0
        order = np.argsort(pos0[r])[-W:]  # the stored window tokens: their rows now
        if n0:
            L0 = (Ks[r, order] @ K[r, :n0].T).astype(np.float64)  # (w, n0)
            for idx, j in enumerate(order):
                w = int(pos0[r, j]) % W
                M[w] = L0[idx].max()
                E[w, :n0] = np.exp(L0[idx] - M[w])
                valid[w], row_vi[w] = True, j
        col = np.zeros(N, np.int64)
        for i0 in range(0, k, BLOCK):
            i1 = min(k, i0 + BLOCK)
            cols = np.concatenate([live[:n_live], np.arange(n0 + i0, n0 + i1)])
            col[cols] = np.arange(len(cols))
            G = Ks[r, n0 + i0 : n0 + i1] @ K[r, cols].T
            n_live = _replay(G, col, i0, row_vi, E, M, valid, live, n_live, pos[r], evicted[r],
                             n0, t0, W, c.budget, c.recent, c.n_sink, fusion)
        alive[r, live[:n_live]] = True
        m[r] = n_live
    slots = int(m[0])
    engine.due = slots > c.budget
    kept = np.argsort(~alive, axis=1, kind="stable")[:, :slots]
    return evicted, kept, slots
