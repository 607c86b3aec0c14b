"""Compiled host kernels (numba) of the engine's two hot steps: attention rows and block picks.

``rows`` turns one batched product's logits into attention rows (softmax per query head over
the keys present at the query's arrival, summed over the group, rounded to float16 for real
queries), and ``pick`` chooses a block of victims. They compute exactly what the NumPy
definitions do (``tests/test_block.py`` holds them to those): float64 throughout, an exp within
one ulp of NumPy's before the float16 rounding, the same tie rule. Compiled once per machine
(``cache=True`` keeps the machine code beside this file, or in ``NUMBA_CACHE_DIR``).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

TIE_RTOL = 1e-9
NO_POSITION = np.iinfo(np.int64).max
SCAN = 8  # blocks up to this pick by repeated scans, larger ones sort once per row


# ---- float16 on the host without float16 support: values as uint16 bit patterns ------------
_POW = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 31)] + [np.inf])


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


@njit(cache=True)
def rows(logits, slots, finite, top, half, out, out_bits):
    """Rows of P queries from their logits (R, P, G, n): query p sees keys j <= slots[p].
    Softmax per head (NaN -> -inf, +inf -> ``top`` unless ``finite``), summed over the G
    heads into out (R, P, n) float64; with ``half`` also rounded to float16 bits into
    out_bits (R, P, n) uint16."""
    R, P, G, n = logits.shape
    weights, scratch, row = np.empty(n), np.empty(n), np.empty(n)
    for r in range(R):
        for p in range(P):
            m = slots[p] + 1
            for j in range(n):
                row[j] = 0.0
            for g in range(G):
                x = logits[r, p, g]
                if not finite:
                    for j in range(m):
                        if x[j] != x[j]:
                            x[j] = -np.inf
                        elif x[j] == np.inf:
                            x[j] = top
                peak = _peak(x, m)
                if not np.isfinite(peak):
                    peak = 0.0
                _exp_shifted(x, m, peak, weights, scratch)
                total = _sum(weights, m)
                inv = 1.0 / (total if total > 0.0 else 1.0)
                for j in range(m):
                    row[j] += inv * weights[j]
            for j in range(n):
                out[r, p, j] = row[j]
            if half:
                _to_half(row, n, out_bits[r, p])


@njit(cache=True)
def pick(scores, positions, block, out):
    """``block`` successive picks per row of the lowest score (R, n), ties within TIE_RTOL
    (relative) to the oldest position; a picked slot leaves the candidates. Small blocks scan;
    larger ones sort, once per row, the slots scoring at most the block-th lowest score times
    (1 + TIE_RTOL), which holds every pick (the candidates tied with the lowest remaining score
    are a prefix of the remaining ones in score order)."""
    R, n = scores.shape
    taken = np.zeros(n, np.bool_)
    for r in range(R):
        taken[:] = False
        if block <= SCAN:
            for k in range(block):
                out[r, k] = _scan(scores[r], positions[r], taken)
                taken[out[r, k]] = True
            continue
        # every pick scores <= (the block-th lowest score) * (1 + TIE_RTOL): sort only those
        kth = np.partition(scores[r], block - 1)[block - 1]
        if kth == kth:
            cut = kth * (1.0 + TIE_RTOL)
            near = np.nonzero(scores[r] <= cut)[0]
            order = near[np.argsort(scores[r][near])]
        else:  # NaN scores: all of them, NaN last
            order = np.argsort(scores[r])
        m = order.size
        first = 0  # the lowest untaken entry of ``order``
        for k in range(block):
            while taken[order[first]]:
                first += 1
            limit = scores[r, order[first]] * (1.0 + TIE_RTOL)
            best, oldest = order[first], positions[r, order[first]]
            i = first + 1
            while i < m and scores[r, order[i]] <= limit:
                j = order[i]
                if not taken[j] and positions[r, j] < oldest:
                    best, oldest = j, positions[r, j]
                i += 1
            taken[best] = True
            out[r, k] = best


@njit(cache=True)
def _scan(scores, positions, taken):
    """The oldest untaken slot among those within TIE_RTOL of the lowest untaken score."""
    low = np.inf
    for j in range(scores.size):
        if not taken[j] and scores[j] < low:
            low = scores[j]
    limit = low * (1.0 + TIE_RTOL)
    best, oldest = 0, NO_POSITION
    for j in range(scores.size):
        if not taken[j] and scores[j] <= limit and positions[j] < oldest:
            best, oldest = j, positions[j]
    return best


@njit(cache=True, fastmath={"reassoc", "contract"})
def dots(q, keys, scale, out):
    """out[r, p, g, j] = (q[r, p, g] * scale) . keys[r, j] in float64 (exact products; the
    summation order is the compiler's), for few queries: no float64 copy of the keys."""
    R, P, G, D = q.shape
    n = keys.shape[1]
    qs = np.empty((P * G, D))
    for r in range(R):
        for p in range(P):
            for g in range(G):
                for d in range(D):
                    qs[p * G + g, d] = np.float64(q[r, p, g, d]) * scale
        for j in range(n):
            for i in range(P * G):
                acc = 0.0
                for d in range(D):
                    acc += qs[i, d] * np.float64(keys[r, j, d])
                out[r, i // G, i % G, j] = acc


@njit(cache=True)
def moves(victims, n, src, dst):
    """Row moves (src, dst) (R, block) that fill the victims' rows below the line
    ``n - block`` with the live rows above it, in order; the remaining pairs move a victim's
    row above the line onto itself (``tests/numpy_definitions.compaction`` defines them)."""
    R, block = victims.shape
    line = n - block
    dead = np.zeros(block, np.bool_)
    for r in range(R):
        dst[r] = np.sort(victims[r])
        dead[:] = False
        for k in range(block):
            v = victims[r, k]
            if v >= line:
                dead[v - line] = True
        i = 0
        for k in range(block):  # live rows above the line first, then the victims there
            if not dead[k]:
                src[r, i] = line + k
                i += 1
        for k in range(block):
            if dead[k]:
                src[r, i] = line + k
                i += 1


@njit(cache=True)
def half_mean(bits, out):
    """out (R, n) = the mean over axis 1 of float16 rows given as bits (R, W, n) uint16,
    values >= 0 (their sum is exact in float64 in any order, as NumPy's)."""
    R, W, n = bits.shape
    for r in range(R):
        for j in range(n):
            out[r, j] = 0.0
        for w in range(W):
            for j in range(n):
                b = bits[r, w, j]
                e = b >> 10
                m = b & 1023
                out[r, j] += (m if e == 0 else m + 1024) * _POW[e]
        for j in range(n):
            out[r, j] /= W


@njit(cache=True)
def select(scores, norm_bits, positions, n_sink, last, block, out):
    """``pick`` over scores (R, n) float64 times the value norms (float16 bits (R, n) uint16;
    an empty array: none), the slots at positions < n_sink or > last protected (inf)."""
    R, n = scores.shape
    final = np.empty((R, n))
    weighted = norm_bits.size > 0
    for r in range(R):
        for j in range(n):
            p = positions[r, j]
            if p < n_sink or p > last:
                final[r, j] = np.inf
            elif weighted:
                b = norm_bits[r, j]
                e = b >> 10
                m = b & 1023
                final[r, j] = scores[r, j] * ((m if e == 0 else m + 1024) * _POW[e])
            else:
                final[r, j] = scores[r, j]
    pick(final, positions, block, out)
