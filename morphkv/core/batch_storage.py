"""The shared storage of ``BatchMorphKVCache``: one (B, n_kv_heads, capacity, head_dim) array
per K and V for all rows (or mlx_lm's quantized triplets, ``morphkv.core.quant``).

Each row's live tokens are its first ``stored`` slots (left-aligned, in the row's own engine's
slot order); what lies past them is free (stale or zero) and hidden by the mask. Every
operation here is a constant number of MLX operations whatever the number of rows: a decode
step writes all rows' new tokens with one scatter, an eviction moves the evicting rows' slots
with one gather and one scatter, a prefill chunk's compaction is one gather.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import quant
from .storage import to_numpy


def zeros(like: quant.Storage, rows: int, capacity: int) -> quant.Storage:
    """Zero storage of ``rows`` rows and ``capacity`` slots shaped like ``like`` (., H, ., last)."""
    return quant.apply(lambda p: mx.zeros((rows, p.shape[1], capacity, p.shape[3]), p.dtype), like)


def grow(x: quant.Storage, capacity: int) -> quant.Storage:
    """``x`` with ``capacity`` slots (zeros appended)."""
    B, H, N = quant.dims(x)
    if capacity <= N:
        return x
    return quant.apply(lambda p: mx.concatenate(
        [p, mx.zeros((B, H, capacity - N, p.shape[3]), p.dtype)], axis=2), x)


def write_tokens(x: quant.Storage, slots: np.ndarray, new: quant.Storage) -> quant.Storage:
    """Row i's new token (new[i], one column) written at slot ``slots[i]``: one scatter (a
    slice write when every row writes the same slot). Returns the storage (in place)."""
    first = int(slots[0])
    if (slots == first).all():
        quant.assign(x, first, first + 1, new)
        return x
    index = mx.array(slots.astype(np.int32)).reshape(-1, 1, 1, 1)

    def put(p, n):
        return mx.put_along_axis(p, mx.broadcast_to(index, n.shape), n, axis=2)

    return quant.apply(put, x, new)


def move_slots(x: quant.Storage, src: np.ndarray, dst: np.ndarray) -> quant.Storage:
    """Slot ``dst[b, h, k]`` of row b, head h takes slot ``src[b, h, k]`` (all rows at once;
    a row with nothing to move carries src == dst)."""
    B, H, _ = quant.dims(x)
    s = mx.array(src.astype(np.int32).reshape(B, H, -1, 1))
    d = mx.array(dst.astype(np.int32).reshape(B, H, -1, 1))

    def move(p):
        return mx.put_along_axis(p, d, mx.take_along_axis(p, s, axis=2), axis=2)

    return quant.apply(move, x)


def gather_slots(x: quant.Storage, index: np.ndarray) -> quant.Storage:
    """New storage whose slot j of row b, head h is the old slot ``index[b, h, j]``."""
    B, H, _ = quant.dims(x)
    ix = mx.array(index.astype(np.int32).reshape(B, H, -1, 1))
    return quant.apply(lambda p: mx.take_along_axis(p, ix, axis=2), x)


def put_row(x: quant.Storage, i: int, row: quant.Storage, n: int) -> None:
    """Row i's first ``n`` slots from a single-sequence storage ``row`` (1, H, >= n, .)."""
    for part, value in zip(quant._parts(x), quant._parts(row), strict=True):
        part[i : i + 1, :, :n] = value[:, :, :n]


def write_span(x: quant.Storage, i: int, at: int, new: quant.Storage, span) -> None:
    """Row i's slots [at, at + count) = columns [start, start + count) of ``new``'s row i."""
    start, count = span
    for part, value in zip(quant._parts(x), quant._parts(new), strict=True):
        part[i : i + 1, :, at : at + count] = value[i : i + 1, :, start : start + count]


def take_rows(x: quant.Storage, rows: list[int]) -> quant.Storage:
    index = mx.array(np.asarray(rows, np.int32))
    return quant.apply(lambda p: p[index], x)


def concat_rows(a: quant.Storage, b: quant.Storage) -> quant.Storage:
    """Rows of ``a`` then ``b`` (the shorter capacity padded with zeros)."""
    capacity = max(quant.dims(a)[2], quant.dims(b)[2])
    a, b = grow(a, capacity), grow(b, capacity)
    return quant.apply(lambda p, q: mx.concatenate([p, q], axis=0), a, b)


def fetch(x: quant.Storage, n: int) -> quant.Storage:
    """The first ``n`` slots of every row (what attention reads)."""
    if n == quant.dims(x)[2]:
        return x
    return quant.apply(lambda p: p[:, :, :n], x)


def row_copy(x: quant.Storage, i: int, n: int) -> quant.Storage:
    """Row i's first ``n`` slots as its own (1, H, n, .) storage (a copy)."""
    return quant.apply(lambda p: mx.contiguous(p[i : i + 1, :, :n]), x)


def host(x: quant.Storage, config) -> np.ndarray:
    """The storage as a host float array (B, H, slots, D), dequantized when quantized."""
    if config.kv_bits is None:
        return to_numpy(x)
    return quant.host_dequantize(x, config.kv_group_size, config.kv_bits)


def store_form(x: mx.array, config) -> quant.Storage:
    """New keys or values as the storage holds them."""
    if config.kv_bits is None:
        return x
    return quant.quantize(x, config.kv_group_size, config.kv_bits)
