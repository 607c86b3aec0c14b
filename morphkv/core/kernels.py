"""Compiled host kernels (numba) of the selection engine's hot loops, for the rules they know.

The engine (``morphkv.core.engine``) runs a rule through these kernels when ``fused.fused_code``
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
# rule codes (``morphkv.core.fused.fused_code`` maps rules onto them)
RECENCY, MEAN, MAX, NEWEST, CUMULATIVE, PEAK = 0, 1, 2, 3, 4, 5
NO_POSITION = np.iinfo(np.int32).max


# ---- float16 on the host without float16 support: values as uint16 bit patterns ------------
_POW = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 31)] + [np.inf])


@njit(cache=True, inline="always")
def half_value(bits) -> float:
    """The float64 value of any float16 bit pattern (keys and queries)."""
    b = np.int64(bits)
    e = (b >> 10) & 31
    m = b & 1023
    if e == 31:
        v = np.inf if m == 0 else np.nan
    else:
        v = (m + (1024 if e else 0)) * _POW[e]
    return -v if b >> 15 else v


@njit(cache=True, inline="always")
def _prob(bits) -> float:
    """float64 value of a finite float16 >= 0 (ring rows, value norms), branch-free."""
    b = np.int32(bits)
    e = b >> 10
    return np.float64((b & 1023) + (1024 if e > 0 else 0)) * _POW[e]


@njit(cache=True, inline="always")
def half_bits(x) -> np.uint16:
    """float16 bit pattern of ``x`` >= 0 (not NaN), rounded to nearest, ties to even, as
    NumPy's ``astype(np.float16)`` rounds."""
    return np.uint16(_round_half(np.array([x]).view(np.int64)[0]))


@njit(cache=True, inline="always")
def _round_half(b):
    """float16 bits of the float64 >= 0 whose bits are ``b`` (integer ops only)."""
    e = (b >> 52) - 1023
    mant = (b & 0xFFFFFFFFFFFFF) | 0x10000000000000
    shift = min(42 + max(-14 - e, 0), 63)
    m = mant >> shift
    rem = mant & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    m += 1 if (rem > half) or (rem == half and (m & 1)) else 0
    out = m if e < -14 else ((e + 15) << 10) + m - 1024
    return 0x7C00 if (e > 15 or out >= 0x7C00) else out


@njit(cache=True)
def _to_half(row, n, out):
    """out[:n] = float16 bits of row[:n] (values >= 0)."""
    bits = row.view(np.int64)
    for j in range(n):
        out[j] = _round_half(bits[j])


def _widen(x):
    """float64 value of a key/query element (float32, float64, or float16 bits)."""


@overload(_widen)
def _widen_impl(x):
    if isinstance(x, types.Integer):
        def from_half(x):
            return half_value(x)

        return from_half

    def from_float(x):
        return np.float64(x)

    return from_float


# ---- exp, vectorizable: Cody-Waite reduction, degree-13 Taylor (within 1 ulp of NumPy's) ----
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_MAGIC = 6755399441055744.0  # 2**52 + 2**51: adding it rounds to an integer, ties to even
_MAGIC_BITS = int(np.array([_MAGIC]).view(np.int64)[0])
_C = [1.0 / math.factorial(i) for i in range(14)]
_C2, _C3, _C4, _C5, _C6, _C7, _C8, _C9, _C10, _C11, _C12, _C13 = _C[2:]


@njit(cache=True)
def _exp_shifted(x, n, peak, out, scratch):
    """out[:n] = exp(x[:n] - peak) for x - peak <= 0; below -708 it is 0 (such a weight
    vanishes next to the peak's 1 and rounds to float16 zero either way)."""
    for j in range(n):
        v = x[j] - peak
        keep = v > -708.0
        v = v if keep else -708.0
        t = v * _INV_LN2 + _MAGIC
        k = t - _MAGIC
        r = (v - k * _LN2_HI) - k * _LN2_LO
        p = _C13 * r + _C12
        p = p * r + _C11
        p = p * r + _C10
        p = p * r + _C9
        p = p * r + _C8
        p = p * r + _C7
        p = p * r + _C6
        p = p * r + _C5
        p = p * r + _C4
        p = p * r + _C3
        p = p * r + _C2
        p = p * r + 1.0
        p = p * r + 1.0
        out[j] = p if keep else 0.0
        scratch[j] = t
    bits = scratch.view(np.int64)
    for j in range(n):
        bits[j] = (bits[j] - _MAGIC_BITS + 1023) << 52
    for j in range(n):
        out[j] *= scratch[j]


@njit(cache=True, fastmath={"reassoc"})
def _finite(logits, n):
    """No NaN or inf in logits[:, :n] (x * 0 is 0 for finite x, NaN otherwise)."""
    s = 0.0
    for g in range(logits.shape[0]):
        for j in range(n):
            s += logits[g, j] * 0.0
    return s == 0.0


@njit(cache=True, fastmath={"reassoc"})
def _sum(x, n):
    total = 0.0
    for j in range(n):
        total += x[j]
    return total


@njit(cache=True, fastmath={"nnan", "reassoc", "nsz"})
def _peak(x, n):
    """max of x[:n] (no NaN: cleaned before); exact in any order."""
    peak = -np.inf
    for j in range(n):
        peak = max(peak, x[j])
    return peak


@njit(cache=True, fastmath={"reassoc", "contract"})
def _dots(q, keys, r, n, scale, out):
    """out[g, j] = (q[r, g] * scale) . keys[r, j] in float64, j < n, four keys at a time (the
    summation order is the compiler's: the products are exact, the sums differ by ulps)."""
    G, D = q.shape[1], q.shape[2]
    qs = np.empty((G, D))
    for g in range(G):
        for d in range(D):
            qs[g, d] = _widen(q[r, g, d]) * scale
    k = np.zeros((4, D))
    for j in range(0, n, 4):
        m = min(4, n - j)
        for i in range(m):
            for d in range(D):
                k[i, d] = _widen(keys[r, j + i, d])
        for g in range(G):
            a0 = a1 = a2 = a3 = 0.0
            for d in range(D):
                x = qs[g, d]
                a0 += x * k[0, d]
                a1 += x * k[1, d]
                a2 += x * k[2, d]
                a3 += x * k[3, d]
            out[g, j] = a0
            if m > 1:
                out[g, j + 1] = a1
            if m > 2:
                out[g, j + 2] = a2
            if m > 3:
                out[g, j + 3] = a3


@njit(cache=True)
def _causal_row(logits, n, finite, top, ring, r, head, row, scratch):
    """Row of the new token from logits (G, >= n): softmax over n per query head, summed over
    the heads, rounded to float16 into ring[r, head, :n]."""
    G = logits.shape[0]
    for j in range(n):
        row[j] = 0.0
    for g in range(G):
        x = logits[g]
        if not finite:
            for j in range(n):
                if x[j] != x[j]:
                    x[j] = -np.inf
                elif x[j] == np.inf:
                    x[j] = top
        peak = _peak(x, n)
        if not np.isfinite(peak):
            peak = 0.0
        weights = scratch[0]
        _exp_shifted(x, n, peak, weights, scratch[1])
        total = _sum(weights, n)
        inv = 1.0 / (total if total > 0.0 else 1.0)
        for j in range(n):
            row[j] += inv * weights[j]
    _to_half(row, n, ring[r, head])


@njit(cache=True)
def _observe(code, ring, r, head, slots, slot, accumulated, peak, decay):
    """Running scores: a new token's slot starts at 0; h2o adds the newest row; a peak (the
    peak rule, or a window rule fused with one) keeps max(decay * peak, newest row)."""
    if code == CUMULATIVE:
        accumulated[r, slot] = 0.0
        for j in range(slots):
            accumulated[r, j] += _prob(ring[r, head, j])
    elif code == PEAK or peak > 0.0:
        accumulated[r, slot] = 0.0
        for j in range(slots):
            held = accumulated[r, j]
            if decay != 1.0:
                held = held * decay
            accumulated[r, j] = max(held, _prob(ring[r, head, j]))


@njit(cache=True)
def _select(code, r, positions, slots, seen, n_sink, recent, ring, head, accumulated, norms,
            weighted, scores, window_sum, peak):
    """Slot to evict in row r: lowest score among unprotected slots, ties to the oldest."""
    W = ring.shape[1]
    if code == RECENCY:
        for j in range(slots):
            scores[j] = np.float64(positions[r, j])
    elif code == CUMULATIVE or code == PEAK:
        for j in range(slots):
            scores[j] = accumulated[r, j]
    elif code == NEWEST:
        for j in range(slots):
            scores[j] = _prob(ring[r, head, j])
    elif code == MAX:
        for j in range(slots):
            scores[j] = _prob(ring[r, 0, j])
        for w in range(1, W):
            for j in range(slots):
                scores[j] = max(scores[j], _prob(ring[r, w, j]))
    elif window_sum.shape[1] > 0:  # mean, from the chunk's running sums (exact, see below)
        for j in range(slots):
            scores[j] = window_sum[r, j] / W
    else:
        for j in range(slots):
            scores[j] = 0.0
        for w in range(W):
            for j in range(slots):
                scores[j] += _prob(ring[r, w, j])
        for j in range(slots):
            scores[j] = scores[j] / W
    if peak > 0.0:  # max(window score, lambda * peak), before the value weights
        for j in range(slots):
            scores[j] = max(scores[j], peak * accumulated[r, j])
    if weighted:
        for j in range(slots):
            scores[j] = scores[j] * _prob(norms[r, j])
    newest = seen - 1
    low = np.inf
    for j in range(slots):
        p = positions[r, j]
        if p < n_sink or p > newest - recent:
            scores[j] = np.inf
        low = min(low, scores[j])
    limit = low * (1.0 + TIE_RTOL)
    best, oldest = 0, NO_POSITION
    for j in range(slots):
        if scores[j] <= limit and positions[r, j] < oldest:
            best, oldest = j, positions[r, j]
    return best


@njit(cache=True)
def decode_step(code, q, keys, scale, finite, top, positions, ring, accumulated, norms, new_norms,
                weighted, slot, slots, seen, head, evicts, budget, n_sink, recent, dead, peak,
                decay):
    """One token, every row: the token is already placed in ``slot`` (its position and norm
    are written here). ``q`` (rows, G, D) real queries (empty: no attention rows), ``keys``
    (rows, >= slots, D) the stored keys, new token included. Writes ``dead`` (rows,), the slot
    each row evicts (when over the budget). Returns (evicted?, finite): ``finite`` turns False
    for good at the first NaN or inf logit (a non-finite key or query always makes one: float32
    products cannot overflow float64), which is then cleaned as the generic path cleans it."""
    R = positions.shape[0]
    attention = q.shape[1] > 0
    logits = np.empty((max(q.shape[1], 1), slots))
    row, scores, scratch = np.empty(slots), np.empty(slots), np.empty((2, slots))
    no_sum = np.empty((R, 0))
    over = evicts and slots > budget
    for r in range(R):
        s = slot[r]
        positions[r, s] = seen
        if weighted:
            norms[r, s] = new_norms[r]
        if attention:
            _dots(q, keys, r, slots, scale, logits)
            if finite:
                finite = _finite(logits, slots)
            _causal_row(logits, slots, finite, top, ring, r, head, row, scratch)
        _observe(code, ring, r, head, slots, s, accumulated, peak, decay)
        if over:
            dead[r] = _select(code, r, positions, slots, seen + 1, n_sink, recent, ring, head,
                              accumulated, norms, weighted, scores, no_sum, peak)
    return over, finite


@njit(cache=True)
def chunk_block(code, flat, slot_column, n0, start, first_needed, keys, slot_keys, finite, top,
                positions, ring, accumulated, norms, new_norms, weighted, dead, has_dead, slots,
                seen, head, window, evicts, budget, n_sink, recent, evicted, window_sum, peak,
                decay):
    """Tokens start..start+b of a chunk, token by token, as ``decode_step`` would run them.
    ``flat`` (rows, b, G, N) logits of the block's queries against [the slots' keys at the
    block's start (n0 columns) + the block's keys]; ``slot_column`` (rows, >= slots + b) maps
    slots to those columns. ``window_sum`` (rows, capacity): for the mean rule, the sum over
    the ring of each slot's entries, kept up to date as rows are replaced (float16 values add
    and subtract exactly in float64), or (rows, 0). Returns (slots, seen, head, has_dead)."""
    R, b = positions.shape[0], flat.shape[1]
    attention = flat.shape[2] > 0
    G = flat.shape[2]
    cap = positions.shape[1]
    logits = np.empty((max(G, 1), cap))
    row, scores, scratch = np.empty(cap), np.empty(cap), np.empty((2, cap))
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
                    summed = window_sum.shape[1] > 0
                    if summed:
                        for j in range(slots):
                            window_sum[r, j] -= _prob(ring[r, head, j])
                    _causal_row(logits, slots, finite, top, ring, r, head, row, scratch)
                    if summed:
                        for j in range(slots):
                            window_sum[r, j] += _prob(ring[r, head, j])
            _observe(code, ring, r, head, slots, s, accumulated, peak, decay)
            if over:
                dead[r] = _select(code, r, positions, slots, seen + 1, n_sink, recent, ring,
                                  head, accumulated, norms, weighted, scores, window_sum, peak)
                evicted[r, start + i] = positions[r, dead[r]]
        seen += 1
        has_dead = over
    return slots, seen, head, has_dead
