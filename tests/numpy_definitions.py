"""The NumPy definitions the engine's picks and moves (``morphkv.core.device``) are held to,
in plain loops: the block pick, the row moves that compact the storage, the causal attention
rows."""

from __future__ import annotations

import numpy as np


def softmax_sum(logits, finite: bool, top: float):
    """Softmax over the last axis of (..., G, n) logits, summed over G -> (..., n) float64.
    A row without a finite logit (all masked or NaN) is all zeros."""
    if not finite:
        logits = np.nan_to_num(logits, nan=-np.inf, posinf=top, neginf=-np.inf)
    peak = logits.max(axis=-1, keepdims=True)
    if not finite or not np.isfinite(peak).all():
        peak = np.where(np.isfinite(peak), peak, 0.0)
    weights = np.exp(logits - peak)
    total = weights.sum(axis=-1, keepdims=True)
    total = np.where(total > 0, total, 1.0)
    return (weights / total).sum(axis=-2)


def logits_of(queries, keys, scale: float):
    """(rows, P, G, n) float64 scaled logits of queries (rows, P, G, D) against keys
    (rows, n, D); the scale multiplies the queries."""
    R, P, G, D = queries.shape
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf: cleaned after
        q = queries.astype(np.float64).reshape(R, P * G, D) * scale
        dots = q @ keys.astype(np.float64, copy=False).transpose(0, 2, 1)
    return dots.reshape(R, P, G, keys.shape[1])

TIE_RTOL = 1e-9  # scores this close (relative) to the minimum count as tied; oldest goes
NO_POSITION = np.iinfo(np.int32).max


def pick(scores, positions, block: int):
    """``block`` successive picks per row of the lowest score, ties (within ``TIE_RTOL``) to
    the oldest position; each picked slot leaves the candidates."""
    scores, positions = scores.copy(), np.array(positions, np.int64)
    r = np.arange(scores.shape[0])
    out = np.empty((scores.shape[0], block), np.int64)
    for k in range(block):
        low = scores.min(axis=1, keepdims=True)
        tied = scores <= low * (1.0 + TIE_RTOL)
        out[:, k] = np.where(tied, positions, NO_POSITION).argmin(axis=1)
        scores[r, out[:, k]] = np.inf
        positions[r, out[:, k]] = NO_POSITION
    return out


def compaction(victims, n: int, block: int):
    """Row moves (src, dst), each (rows, block), that fill the victims' rows below the line
    ``n - block`` with the live rows above it; the other pairs move a victim's row above the
    line onto itself. Afterwards the live slots are the rows [0, n - block)."""
    R = victims.shape[0]
    if block == 1:  # the top row moves into the hole (onto itself when it is the victim)
        return np.full((R, 1), n - 1, np.int64), victims.astype(np.int64)
    dst = np.sort(victims, axis=1)  # holes below the line first, then victims above it
    above = np.broadcast_to(np.arange(n - block, n), (R, block))
    dead = (victims[:, :, None] == above[:, None, :]).any(axis=1)  # (rows, block)
    order = np.argsort(dead, axis=1, kind="stable")  # live rows above first, then victims
    return np.take_along_axis(above, order, axis=1), dst



def causal_rows_numpy(queries, keys, slots, scale: float, finite: bool, top: float):
    """``causal_rows`` (float64) in NumPy: the definition the kernel is held to."""
    n = keys.shape[1]
    logits = logits_of(queries, keys, scale)
    seen = np.arange(n)[None, :] <= np.asarray(slots)[:, None]  # (P, n)
    if not seen.all():
        logits = np.where(seen[None, :, None, :], logits, -np.inf)  # exp(-inf) is 0
    return softmax_sum(logits, finite, top)

