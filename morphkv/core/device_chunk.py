"""A multi-token update of ``DeviceBatchCache`` (a right-padded prompt, left padding, rows
with history): fed row by row, each row in pieces that end at its own eviction grid
(``DeviceEngine.piece``), written, attended once (``core.attention``) and observed by the
row's engine, as ``MorphKVCache`` feeds one sequence. A due eviction runs through the batch's
one eviction path (``DeviceBatchCache.evict_rows``). Padding columns get a zero output.
"""

from __future__ import annotations

import mlx.core as mx

from . import device_rows, device_schedule, quant, storage
from .attention import attend


def row(x: quant.Storage, i: int) -> quant.Storage:
    return quant.apply(lambda p: p[i : i + 1], x)


def attend_chunk(cache, queries, sinks, new, starts, counts, Dv):
    """The output of a multi-token update (B, n_heads, C, Dv): every row's real tokens fed by
    ``feed_row``, zeros in its padding columns."""
    B, n_heads, C, _ = queries.shape
    zeros = mx.zeros((1, n_heads, C, Dv), queries.dtype)
    outs = []
    for i in range(B):
        s, c = int(starts[i]), int(counts[i])
        if c == 0:
            outs.append(zeros)
            continue
        pieces = [zeros[:, :, :s]] if s else []
        pieces += feed_row(cache, i, queries[i : i + 1, :, s : s + c], sinks, new, s, c)
        if s + c < C:
            pieces.append(zeros[:, :, s + c :])
        outs.append(mx.concatenate(pieces, axis=2) if len(pieces) > 1 else pieces[0])
    return outs[0] if B == 1 else mx.concatenate(outs, axis=0)


def feed_row(cache, i: int, queries, sinks, new, s: int, c: int) -> list:
    """Row i's c real tokens (columns [s, s + c) of ``new``), piece by piece up to its
    eviction grid, as ``MorphKVCache`` feeds one sequence."""
    e, outs, j = cache.engines[i], [], 0
    if device_schedule.fits(e) and c > 1:  # decided first, one attention
        if e.due:
            cache.evict_rows([i])
        device_rows.load(cache._arrays, e, i, cache._H)
        cut = tuple(quant.apply(lambda p: p[i : i + 1, :, s : s + c], x) for x in new)
        held = (row(cache.keys, i), row(cache.values, i))
        out, held = device_schedule.feed(e, held, cut, queries, sinks, cache._quant())
        for x, y in zip((cache.keys, cache.values), held, strict=True):
            storage.put_row(x, i, y, e.capacity)
        device_rows.store(cache._arrays, e, i, cache._H)
        cache.stored[i] = e.slots
        return [out]
    while j < c:
        if e.due:
            cache.evict_rows([i])
        device_rows.load(cache._arrays, e, i, cache._H)
        k = e.piece(c - j)
        n0, n = e.slots, e.slots + k
        for x, y in zip((cache.keys, cache.values), new, strict=True):
            for part, value in zip(quant.parts(x), quant.parts(y), strict=True):
                part[i : i + 1, :, n0:n] = value[i : i + 1, :, s + j : s + j + k]
        out, rows = attend(queries[:, :, j : j + k], row(cache.keys, i),
                           row(cache.values, i), n, cache._scale, sinks, cache._quant())
        e.observe(k, rows if e.needs_rows else None)
        device_rows.store(cache._arrays, e, i, cache._H)
        cache.stored[i] = e.slots
        outs.append(out)
        j += k
    return outs
