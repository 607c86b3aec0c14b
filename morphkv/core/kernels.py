"""Compiled host kernels (numba) of the selection engine's hot loops, for the rules they know.

The engine (``morphkv.core.engine``) runs a rule through these kernels when ``fused_code``
knows the rule and its attention rows are real-query rows (``CausalRows``) or none; any other
rule runs through its own ``score()`` in NumPy. The kernels make the same decisions as that
generic path: they read and write the same state (the float16 ring through a uint16 view,
float16 value norms, float64 running scores), sum float16 values in float64 (exact, so in any
order), and break ties the same way (scores within ``TIE_RTOL`` of the minimum count as tied;
the oldest position goes). Logits are float64 dot products, as in the generic path; only the
order of their summation differs (ulp level, before the rounding of each row to float16).

Compiled once per machine (``cache=True`` stores the machine code beside this file, or in
``NUMBA_CACHE_DIR``); ``warm_up()`` compiles every specialization the engine uses.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.extending import overload

TIE_RTOL = 1e-9
# rule codes (see fused_code)
RECENCY, MEAN, MAX, NEWEST, CUMULATIVE = 0, 1, 2, 3, 4
NO_POSITION = np.iinfo(np.int32).max


def fused_code(rule) -> int | None:
    """Kernel code of ``rule``, or None when only its ``score()`` knows it. Exact class
    checks: a subclass that changes a method is not mistaken for its parent."""
    from . import rules

    kind = type(rule)
    if kind is rules.Recency:
        return RECENCY
    if kind is rules.WindowAttention:
        return NEWEST if rule.newest_only else (MAX if rule.fusion == "max" else MEAN)
    if kind is rules.Cumulative:
        return CUMULATIVE
    return None


# ---- float16 on the host without float16 support: values as uint16 bit patterns ------------
@njit(cache=True, inline="always")
def half_value(bits) -> float:
    """The float64 value of a float16 bit pattern."""
    b = np.int64(bits)
    e = (b >> 10) & 31
    m = b & 1023
    if e == 0:
        v = m * 5.960464477539063e-08  # 2**-24
    elif e == 31:
        v = np.inf if m == 0 else np.nan
    else:
        v = (m + 1024) * math.ldexp(1.0, e - 25)
    return -v if b >> 15 else v


@njit(cache=True, inline="always")
def half_bits(x) -> np.uint16:
    """float16 bit pattern of ``x`` >= 0 (not NaN), rounded to nearest, ties to even, as
    NumPy's ``astype(np.float16)`` rounds."""
    if x < 6.103515625e-05:  # below 2**-14: subnormal, in units of 2**-24 (1024 is 2**-14)
        return np.uint16(np.rint(x * 16777216.0))
    if x >= 65520.0:
        return np.uint16(0x7C00)
    _, e = math.frexp(x)  # x = f * 2**e, 0.5 <= f < 1
    m = np.int64(np.rint(math.ldexp(x, 11 - e)))  # 1024 <= m <= 2048
    if m == 2048:
        m, e = 1024, e + 1
    if e + 14 >= 31:
        return np.uint16(0x7C00)
    return np.uint16(((e + 14) << 10) | (m - 1024))


def _widen(x):
    """float64 value of a key/query element (float32, float64, or float16 bits)."""


@overload(_widen, inline="always")
def _widen_impl(x):
    if isinstance(x, types.Integer):
        return lambda x: half_value(x)
    return lambda x: np.float64(x)


@njit(cache=True, fastmath={"reassoc", "contract"})
def _dots(q, keys, r, n, scale, out):
    """out[g, j] = (q[r, g] * scale) . keys[r, j] in float64, j < n (the summation order is
    the compiler's: products of float32 values are exact, sums differ by ulps)."""
    G, D = q.shape[1], q.shape[2]
    qs = np.empty((G, D))
    for g in range(G):
        for d in range(D):
            qs[g, d] = _widen(q[r, g, d]) * scale
    k = np.empty(D)
    for j in range(n):
        for d in range(D):
            k[d] = _widen(keys[r, j, d])
        for g in range(G):
            acc = 0.0
            for d in range(D):
                acc += qs[g, d] * k[d]
            out[g, j] = acc


@njit(cache=True)
def _causal_row(logits, n, finite, top, ring, r, head, row):
    """Row of the new token from logits (G, >= n): softmax over n per query head, summed over
    the heads, rounded to float16 into ring[r, head, :n]."""
    G = logits.shape[0]
    for j in range(n):
        row[j] = 0.0
    for g in range(G):
        peak = -np.inf
        for j in range(n):
            x = logits[g, j]
            if not finite:
                if x != x:
                    x = -np.inf
                elif x == np.inf:
                    x = top
                logits[g, j] = x
            if x > peak:
                peak = x
        if not finite and not np.isfinite(peak):
            peak = 0.0
        total = 0.0
        for j in range(n):
            w = math.exp(logits[g, j] - peak)
            logits[g, j] = w
            total += w
        if total <= 0.0:
            total = 1.0
        inv = 1.0 / total
        for j in range(n):
            row[j] += inv * logits[g, j]
    for j in range(n):
        ring[r, head, j] = half_bits(row[j])


@njit(cache=True)
def _observe(code, ring, r, head, slots, slot, accumulated):
    """Running scores: a new token's slot starts at 0; h2o adds the newest row."""
    if code == CUMULATIVE:
        accumulated[r, slot] = 0.0
        for j in range(slots):
            accumulated[r, j] += half_value(ring[r, head, j])


@njit(cache=True)
def _select(code, r, positions, slots, seen, n_sink, recent, ring, head, accumulated, norms,
            weighted, scores):
    """Slot to evict in row r: lowest score among unprotected slots, ties to the oldest."""
    newest = seen - 1
    W = ring.shape[1]
    low = np.inf
    for j in range(slots):
        p = positions[r, j]
        if p < n_sink or p > newest - recent:
            s = np.inf
        else:
            if code == RECENCY:
                s = np.float64(p)
            elif code == CUMULATIVE:
                s = accumulated[r, j]
            elif code == NEWEST:
                s = half_value(ring[r, head, j])
            elif code == MAX:
                s = half_value(ring[r, 0, j])
                for w in range(1, W):
                    s = max(s, half_value(ring[r, w, j]))
            else:
                s = 0.0
                for w in range(W):
                    s += half_value(ring[r, w, j])
                s = s / W
            if weighted:
                s = s * half_value(norms[r, j])
        scores[j] = s
        if s < low:
            low = s
    limit = low * (1.0 + TIE_RTOL)
    best, oldest = 0, NO_POSITION
    for j in range(slots):
        if scores[j] <= limit and positions[r, j] < oldest:
            best, oldest = j, positions[r, j]
    return best


@njit(cache=True)
def decode_step(code, q, keys, scale, finite, top, positions, ring, accumulated, norms, new_norms,
                weighted, slot, slots, seen, head, evicts, budget, n_sink, recent, dead):
    """One token, every row: the token is already placed in ``slot`` (its position and norm
    are written here). ``q`` (rows, G, D) real queries (empty: no attention rows), ``keys``
    (rows, >= slots, D) the stored keys, new token included. Writes ``dead`` (rows,), the slot
    each row evicts (when over the budget); returns whether it evicted."""
    R = positions.shape[0]
    attention = q.shape[1] > 0
    logits = np.empty((max(q.shape[1], 1), slots))
    row = np.empty(slots)
    scores = np.empty(slots)
    over = evicts and slots > budget
    for r in range(R):
        s = slot[r]
        positions[r, s] = seen
        if weighted:
            norms[r, s] = new_norms[r]
        if attention:
            _dots(q, keys, r, slots, scale, logits)
            _causal_row(logits, slots, finite, top, ring, r, head, row)
        _observe(code, ring, r, head, slots, s, accumulated)
        if over:
            dead[r] = _select(code, r, positions, slots, seen + 1, n_sink, recent, ring, head,
                              accumulated, norms, weighted, scores)
    return over


@njit(cache=True)
def chunk_block(code, flat, slot_column, n0, start, first_needed, keys, slot_keys, finite, top,
                positions, ring, accumulated, norms, new_norms, weighted, dead, has_dead, slots,
                seen, head, window, evicts, budget, n_sink, recent, evicted):
    """Tokens start..start+b of a chunk, token by token, as ``decode_step`` would run them.
    ``flat`` (rows, b, G, N) logits of the block's queries against [the slots' keys at the
    block's start (n0 columns) + the block's keys]; ``slot_column`` (rows, >= slots + b) maps
    slots to those columns. Returns (slots, seen, head, has_dead)."""
    R, b = positions.shape[0], flat.shape[1]
    attention = flat.shape[2] > 0
    G = flat.shape[2]
    cap = positions.shape[1]
    logits = np.empty((max(G, 1), cap))
    row = np.empty(cap)
    scores = np.empty(cap)
    for i in range(b):
        if not has_dead:
            slots += 1
        if attention:
            head = (head + 1) % window
        over = evicts and slots > budget
        for r in range(R):
            s = dead[r] if has_dead else slots - 1
            positions[r, s] = seen
            if weighted:
                norms[r, s] = new_norms[r, start + i]
            if attention:
                if slot_keys.shape[1] > 0:
                    slot_keys[r, s] = keys[r, start + i]
                slot_column[r, s] = n0 + i
                if start + i >= first_needed:
                    for g in range(G):
                        for j in range(slots):
                            logits[g, j] = flat[r, i, g, slot_column[r, j]]
                    _causal_row(logits, slots, finite, top, ring, r, head, row)
            _observe(code, ring, r, head, slots, s, accumulated)
            if over:
                dead[r] = _select(code, r, positions, slots, seen + 1, n_sink, recent, ring,
                                  head, accumulated, norms, weighted, scores)
                evicted[r, start + i] = positions[r, dead[r]]
        seen += 1
        has_dead = over
    return slots, seen, head, has_dead
