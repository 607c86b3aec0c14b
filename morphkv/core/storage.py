"""The K/V storage of morphkv caches: one (B, n_kv_heads, capacity, head_dim) array per K and V.

Plain arrays in the arriving dtype, or mlx_lm's quantized triplets (``morphkv.core.quant``).
Each batch row's live tokens are its first ``stored`` slots (left-aligned, in its engine's slot
order); what lies past them is free (stale or zero) and hidden. Every operation here is a
constant number of MLX operations whatever the number of rows: a decode step writes every row's
new token with one slice write (one scatter when rows differ in length). The single-sequence
cache and the batch caches share all of it, and the one input check.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import quant

STEP = 256  # storage grows in steps of this many slots (an evicting cache: to budget + 1)


def check(keys, values, stored_keys, stored_values, config, rows: int | None) -> None:
    """Reject malformed input (one line naming the problem): keys and values must be a floating
    (batch, n_kv_heads, tokens, head_dim) pair agreeing with each other, with ``config`` and
    with the storage (``rows``: the batch it holds, None before the first update)."""
    k, v = keys.shape, values.shape
    if keys.ndim != 4 or values.ndim != 4:
        raise ValueError("keys and values must be (batch, n_kv_heads, tokens, head_dim); "
                         f"got keys {tuple(k)} and values {tuple(v)}")
    if k[:3] != v[:3]:
        raise ValueError(f"keys {tuple(k)} and values {tuple(v)} disagree on batch, heads or "
                         "tokens")
    if not mx.issubdtype(keys.dtype, mx.floating):
        raise ValueError(f"keys must be floating point, got {keys.dtype}")
    if 0 in (k[0], k[1], k[3], v[3]):
        raise ValueError("batch, n_kv_heads and head_dim must be >= 1; got keys "
                         f"{tuple(k)} and values {tuple(v)}")
    if rows is not None and k[0] != rows:
        raise ValueError(f"keys of shape {tuple(k)} do not match a batch of {rows} rows")
    if config.head_dim is not None and k[3] != config.head_dim:
        raise ValueError(f"keys have head_dim {k[3]} but config.head_dim={config.head_dim}")
    group = config.kv_group_size
    if config.kv_bits is not None and (k[3] % group or v[3] % group):
        raise ValueError(f"kv_group_size={group} must divide the head dims of keys {k[3]} and "
                         f"values {v[3]}")
    if stored_keys is None:
        return
    for name, new, old in (("keys", keys, stored_keys), ("values", values, stored_values)):
        H, D = quant.dims(old)[1], quant.head_dim(old, group)
        if (new.shape[1], new.shape[3]) != (H, D):
            raise ValueError(f"{name} of shape {tuple(new.shape)} do not match the cache: "
                             f"expected n_kv_heads {H}, head_dim {D}")
        stored = quant.dtype(old)  # quantized: scale_dtype's, or an older save's float32
        if stored != new.dtype and not (
                isinstance(old, tuple) and stored == quant.scale_dtype(new.dtype)):
            raise ValueError(f"{name} dtype {new.dtype} differs from the stored {stored}")


class Accepted(tuple):
    """The config, shapes and dtypes of the last accepted update (``accepted``); a copy of a
    cache starts without one (MLX dtypes do not deep-copy)."""

    def __deepcopy__(self, memo):
        return None


def accepted(keys, values, config, last, stored_keys, stored_values, rows):
    """``check`` with a fast path: input shaped like the ``last`` accepted one passes at once
    (the checks depend on nothing else). Returns what to pass as ``last`` next time."""
    k, v = keys.shape, values.shape
    seal = (keys.ndim, values.ndim, k[:2], k[3:], v[:2], v[3:], keys.dtype, values.dtype)
    if last is not None and last[0] is config and last[1] == seal and k[2] == v[2]:
        return last
    check(keys, values, stored_keys, stored_values, config, rows)
    return None if stored_keys is None else Accepted((config, seal))


def store_form(x: mx.array, config) -> quant.Storage:
    """New keys or values as the storage holds them."""
    if config.kv_bits is None:
        return x
    return quant.quantize(x, config.kv_group_size, config.kv_bits)


def floats(x: quant.Storage, config) -> mx.array:
    """Stored keys or values as a float MLX array (dequantized when quantized)."""
    return quant.dequantize(x, config.kv_group_size, config.kv_bits)


def capacity(slots: int, config, evicts: bool) -> int:
    """The one growth rule: slots of storage that hold ``slots`` (steps of ``STEP``; never
    past ``budget + 1`` for an evicting rule unless a chunk itself needs more)."""
    grown = -(-slots // STEP) * STEP
    return max(slots, min(grown, config.budget + 1)) if evicts else grown


def zeros(like: quant.Storage, rows: int, slots: int) -> quant.Storage:
    """Zero storage of ``rows`` rows and ``slots`` slots shaped like ``like`` (., H, ., last)."""
    return quant.apply(lambda p: mx.zeros((rows, p.shape[1], slots, p.shape[3]), p.dtype), like)


def grow(x: quant.Storage, slots: int) -> quant.Storage:
    """``x`` with ``slots`` slots (zeros appended)."""
    B, H, N = quant.dims(x)
    if slots <= N:
        return x
    return quant.apply(lambda p: mx.concatenate(
        [p, mx.zeros((B, H, slots - N, p.shape[3]), p.dtype)], axis=2), x)


def write(x: quant.Storage, slots: np.ndarray, new: quant.Storage) -> quant.Storage:
    """Row i's new tokens (``new``'s row i) written from slot ``slots[i]`` on: a slice write in
    place when every row starts at the same slot, else one scatter (one token). Returns x."""
    first = int(slots[0])
    if len(slots) == 1 or all(s == first for s in slots):
        quant.assign(x, first, first + quant.dims(new)[2], new)
        return x
    index = mx.array(np.asarray(slots, np.int32)).reshape(-1, 1, 1, 1)

    def put(p, n):
        return mx.put_along_axis(p, mx.broadcast_to(index, n.shape), n, axis=2)

    return quant.apply(put, x, new)


def fetch(x: quant.Storage, n: int, start: int = 0) -> quant.Storage:
    """Slots [start, n) of every row (the first ``n``: what attention reads)."""
    if isinstance(x, tuple):
        return x if start == 0 and n == x[0].shape[2] else tuple(p[:, :, start:n] for p in x)
    return x if start == 0 and n == x.shape[2] else x[:, :, start:n]


def put_row(x: quant.Storage, i: int, row: quant.Storage, n: int) -> None:
    """Row i's first ``n`` slots from a one-row storage ``row`` (1, H, >= n, .)."""
    for part, value in zip(quant.parts(x), quant.parts(row), strict=True):
        part[i : i + 1, :, :n] = value[:, :, :n]


def take_rows(x: quant.Storage, rows: list[int]) -> quant.Storage:
    index = mx.array(np.asarray(rows, np.int32))
    return quant.apply(lambda p: p[index], x)


def concat_rows(a: quant.Storage, b: quant.Storage) -> quant.Storage:
    """Rows of ``a`` then ``b`` (the shorter capacity padded with zeros)."""
    slots = max(quant.dims(a)[2], quant.dims(b)[2])
    a, b = grow(a, slots), grow(b, slots)
    return quant.apply(lambda p, q: mx.concatenate([p, q], axis=0), a, b)


def concat_batches(a, b, rows_a: int, rows_b: int, slots: int):
    """Rows of ``a`` then ``b``, a side without storage (None) as zero rows; None if neither
    has any."""
    if a is None and b is None:
        return None
    a = zeros(b, rows_a, slots) if a is None else a
    b = zeros(a, rows_b, slots) if b is None else b
    return concat_rows(a, b) if rows_a else b


def concat_rows_all(rows: list) -> quant.Storage:
    """One storage of the given row storages, in order (equal capacities)."""
    return quant.apply(lambda *ps: mx.concatenate(ps, axis=0), *rows)


def row_copy(x: quant.Storage, i: int, n: int) -> quant.Storage:
    """Row i's first ``n`` slots as its own (1, H, n, .) storage (a copy)."""
    return quant.apply(lambda p: mx.contiguous(p[i : i + 1, :, :n]), x)
