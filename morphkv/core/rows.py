"""Attention rows, computed in batches: what the attention rules (morphkv, tova, h2o, peak) read.

A row is the attention one query paid to the tokens stored when it arrived: a softmax over
those keys per query head, summed over the query heads that share the KV head. Between two
evictions the stored set only grows (tokens are appended in arrival order, so slot order is
arrival order for them), so query q, held in slot ``s_q``, saw exactly the slots ``<= s_q``:
the rows of every query since the last eviction come from ONE batched product of those queries
with the stored keys under that causal mask (``causal_rows``). Nothing here depends on how the
queries are batched: the products are float64 (exact for float16/float32 inputs), only their
summation order depends on BLAS, at the ulp level, below the float16 rounding of real-query
rows (and within the engine's tie tolerance for proxy rows).

* Real queries (the paper's estimator): rows are rounded to float16 and the last ``window`` of
  them kept in a ring, one row per absolute position ``t % window`` (``window`` float16 numbers
  per slot). A row is never revised. A slot refilled after an eviction keeps stale entries only
  in rows older than its token, which leave the ring before the token stops being protected
  (``recent >= window``), so they never decide anything.
* Keys as proxy queries: the window's rows are recomputed at each eviction from the stored
  keys of the last ``window`` tokens over every stored key (``proxy_rows``), as the proxy rule
  defines them (float64, never rounded); running scores (h2o, peak) take each token's own key
  as its query, like a real query.
"""

from __future__ import annotations

import numpy as np

from . import kernels
from .host_blas import one_blas_thread

SMALL = 4  # at most this many queries: products in a compiled loop, else one BLAS matmul


def clean(logits, top: float):
    """NaN logits become -inf (zero attention); +inf becomes the largest finite float."""
    return np.nan_to_num(logits, nan=-np.inf, posinf=top, neginf=-np.inf)


def softmax_sum(logits, finite: bool, top: float):
    """Softmax over the last axis of (..., G, n) logits, summed over G -> (..., n) float64.
    A row without a finite logit (all masked or NaN) is all zeros."""
    if not finite:
        logits = clean(logits, top)
    peak = logits.max(axis=-1, keepdims=True)
    if not finite or not np.isfinite(peak).all():
        peak = np.where(np.isfinite(peak), peak, 0.0)
    weights = np.exp(logits - peak)
    total = weights.sum(axis=-1, keepdims=True)
    total = np.where(total > 0, total, 1.0)
    return (weights / total).sum(axis=-2)


def logits_of(queries, keys, scale: float):
    """(rows, P, G, n) float64 scaled logits of queries (rows, P, G, D) against keys (rows, n, D).
    The scale multiplies the queries, the smaller operand."""
    R, P, G, D = queries.shape
    with np.errstate(invalid="ignore", over="ignore"), one_blas_thread():  # NaN/inf: cleaned after
        q = queries.astype(np.float64).reshape(R, P * G, D) * scale
        dots = q @ keys.astype(np.float64, copy=False).transpose(0, 2, 1)
    return dots.reshape(R, P, G, keys.shape[1])


def causal_rows(queries, keys, slots, scale: float, finite: bool, top: float, half: bool):
    """Rows (rows, P, n) of P queries held in ``slots`` (P,) (the same for every row), each
    over the stored keys (rows, n, D) in slots <= its own: float64, or float16 with ``half``
    (compiled: ``kernels.rows``)."""
    R, P, G, _ = queries.shape
    wide = (np.float32, np.float64)  # the kernel's signatures (no float16 in numba)
    if P <= SMALL and keys.dtype in wide and queries.dtype in wide:  # no float64 key copy
        logits = np.empty((R, P, G, keys.shape[1]))
        kernels.dots(np.ascontiguousarray(queries), np.ascontiguousarray(keys), scale, logits)
    else:
        logits = np.ascontiguousarray(logits_of(queries, keys, scale))
    n = logits.shape[-1]
    out = np.empty((R, P, n))
    bits = np.empty((R, P, n) if half else (1, 1, 1), np.uint16)
    kernels.rows(logits, np.asarray(slots, np.int64), finite, top, half, out, bits)
    return bits.view(np.float16) if half else out


def proxy_rows(keys, positions, window: int, scale: float, finite: bool, top: float):
    """(rows, window, n) float64: the stored keys of the newest ``window`` tokens as queries
    over every stored key (the proxy rule's window, as stored now)."""
    newest = np.argsort(positions, axis=1, kind="stable")[:, -window:]  # (rows, W) slots
    queries = np.take_along_axis(keys, newest[..., None], axis=1)[:, :, None]  # (rows, W, 1, D)
    return softmax_sum(logits_of(queries, keys, scale), finite, top)
