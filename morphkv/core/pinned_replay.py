"""``schedule``'s steady state for a pinned prompt over the budget, many tokens per pass.

Where every candidate of every row is pinned (now and for the rest of the chunk: a pinned
prompt, ``pin="prompt"``) and KeyDiff ranks the pinned (``pin_rank="keydiff"``), each chunk
token evicts one row (``block`` 1): the candidate whose unit key is most like the running sum
of the alive unit keys (``device_schedule._KeyGeometry``), ties to the oldest. The per-token
loop scores every virtual row in float64 for each token (most of a pinned prefill's host
time: ~40 ms per layer for 512 tokens over 1,024 rows). ``advance`` replays up to ``STEPS``
tokens on a compact float32 copy of the rows that can be picked in them (the alive ones and
the chunk rows arriving meanwhile, in position order), one small matmul and a few tiny
operations per token, the running sum kept in float64 exactly as the loop keeps it (the same
additions in the same order: the same bits).

Every pick is then the loop's: a pick whose float32 score leads the runner-up by more than
float32 rounding can move (``TOL32``: error analysis of a D-term dot product) is the loop's;
the others are scored again in float64 (one matmul for them all) and must agree and lead by
more than float64 rounding can move (``TOL``). The replay stops before the first token that
fails (a tie, a near-tie, a row without candidates): the loop decides it itself.
``schedule`` calls it only in that steady state (recency rule, block 1, pinned ranked by
KeyDiff, no unpinned candidate left in any row, alive or still to come).
"""

from __future__ import annotations

import numpy as np

STEPS = 64  # tokens replayed per pass (one compact copy and one check per pass)
TOL = 1e-11  # a float64 pick's lead over the runner-up, per unit of |sum| (its error ~1e-14)
# a float32 pick's, per unit of |sum| and key dimension: two scores, each off by at most
# (D + 3) * 2**-24 * |sum| (D-term dot product of rounded unit key and sum), with room
TOL32 = 2.1 * 2.0**-24
NEVER = np.iinfo(np.int32).max


def advance(geometry, alive, evicted, pos, unsunk, i: int, k: int, n0: int, t0: int,
            recent: int) -> int:
    """Decide the evictions of chunk tokens ``i``, ``i + 1``, ... (each evicts one row; the
    last token, ``k - 1``, none) as the per-token loop would, starting where the loop has
    marked token ``i`` arrived and added its key to ``geometry``. Updates ``alive``,
    ``evicted`` and ``geometry.total`` as the loop would after the last decided token
    (before the next one arrives); returns how many tokens were decided (0: the loop decides
    token ``i`` itself)."""
    steps = min(STEPS, k - 1 - i)
    if steps <= 0:
        return 0
    R = pos.shape[0]
    rows = np.arange(R)
    last = i + steps - 1  # the last token decided here
    # the rows that can be picked by then: unsunk, not evicted, arrived by ``last``
    reach = unsunk & (evicted == NEVER)
    reach[:, n0 + last + 1 :] = False
    count = reach.sum(axis=1)
    c = int(count.max())
    if c == 0:
        return 0
    # per row its reachable virtual rows in position order (padding: a never-candidate)
    order = np.argsort(np.where(reach, pos, np.iinfo(np.int64).max), axis=1, kind="stable")
    idx = order[:, :c]
    valid = np.arange(c)[None] < count[:, None]
    units = geometry.units[rows[:, None], idx]  # (R, c, D) float64
    fast = np.ascontiguousarray(units.astype(np.float32).transpose(0, 2, 1))  # (R, D, c)
    # the first token at which each compact row is a candidate (alive and old enough)
    ready = np.take_along_axis(pos, idx, axis=1) - t0 + recent
    ready = np.where(valid, ready, np.iinfo(np.int64).max)
    keys, picks, before = _replay(geometry, units, fast, ready, i, n0 + i, steps)
    done = _sure(units, ready, i, keys, picks, before)
    if done:
        taken = np.take_along_axis(idx, picks[:done].T, axis=1)  # (R, done) virtual rows
        evicted[rows[:, None], taken] = np.arange(i, i + done, dtype=np.int32)[None]
        alive[:, n0 + i + 1 : n0 + i + done] = True
        alive[rows[:, None], taken] = False
        geometry.total = before[done - 1] - units[rows, picks[done - 1]]
    return done


def _replay(geometry, units, fast, ready, i: int, at: int, steps: int):
    """The picks of ``steps`` tokens (token ``i``, virtual row ``at``, on), scored in float32
    (the running sum itself kept in float64 as the loop keeps it: the same additions in the
    same order, the same bits). Returns (keys (steps, R, 1, c): each token's float32 scores,
    -inf where no candidate; picks (steps, R): compact indices; before (steps, R, D): the
    running sum each token was scored with)."""
    R, D, c = fast.shape
    rows = np.arange(R)
    keys = np.empty((steps, R, 1, c), np.float32)
    picks = np.empty((steps, R), np.int64)
    before = np.empty((steps, R, D))
    before[0] = geometry.total
    total32 = np.empty((R, 1, D), np.float32)
    closed = np.where(ready <= i, np.float32(0), np.float32(-np.inf))  # -inf: no candidate
    # the compact rows that become candidates at each later token: [bounds[t], bounds[t + 1])
    r_late, j_late = np.nonzero((ready > i) & (ready < i + steps))
    when = ready[r_late, j_late] - i
    by = np.argsort(when, kind="stable")
    r_late, j_late = r_late[by], j_late[by]
    bounds = np.searchsorted(when[by], np.arange(steps + 1)).tolist()
    arrivals = geometry.units[:, at + 1 : at + steps]
    for t in range(steps):
        total = before[t]
        if bounds[t + 1] > bounds[t]:
            closed[r_late[bounds[t] : bounds[t + 1]], j_late[bounds[t] : bounds[t + 1]]] = 0
        np.copyto(total32[:, 0], total, casting="same_kind")
        key = np.matmul(total32, fast, out=keys[t])[:, 0]
        key += closed
        v = key.argmax(axis=1, out=picks[t])
        closed[rows, v] = -np.inf
        if t + 1 < steps:  # the loop's ``geometry.add``: the pick goes, the next token comes
            np.subtract(total, units[rows, v], out=before[t + 1])
            before[t + 1] += arrivals[:, t]
    return keys, picks, before


def _margin(keys, picks):
    """(steps, R): how far each pick's score leads the best other candidate's (-inf: none)."""
    at = np.arange(keys.shape[0])[:, None], np.arange(keys.shape[1])[None], picks
    best = keys[at]
    keys[at] = -np.inf
    return np.where(np.isfinite(best), best - keys.max(axis=2), -np.inf)


def _sure(units, ready, i: int, keys, picks, before) -> int:
    """How many of the replayed tokens, from the first, picked what the loop picks: a pick
    leading by more than float32 rounding can move is; the others are scored again in
    float64 (one matmul for them all) and must agree and lead by more than its rounding."""
    steps, R = picks.shape
    norm = np.sqrt((before * before).sum(axis=2))  # (steps, R): |running sum|
    slack = TOL32 * (before.shape[-1] + 3) * (norm + 1.0)
    unsure = (_margin(keys[:, :, 0], picks) <= slack).any(axis=1)
    if not unsure.any():
        return steps
    q = np.flatnonzero(unsure)
    first = np.full(ready.shape, steps)  # the token each compact row went at
    first[np.arange(R)[:, None], picks.T] = np.arange(steps)[None]
    exact = np.matmul(units, before[q].transpose(1, 2, 0)).transpose(2, 0, 1)  # (q, R, c)
    shut = (ready[None] > i + q[:, None, None]) | (first[None] < q[:, None, None])
    exact[shut] = -np.inf
    again = exact.argmax(axis=2)
    ok = (again == picks[q]) & (_margin(exact, again) > TOL * (norm[q] + 2.0))
    bad = ~ok.all(axis=1)
    return int(q[np.argmax(bad)]) if bad.any() else steps
