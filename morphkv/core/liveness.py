"""Which stored rows each query of a multi-token chunk may see, for exact chunked prefill.

Query i of a chunk sees exactly what would be stored had the chunk been fed one token at a
time: every token kept before the chunk that was not evicted before step i, and the chunk's
tokens up to i.
"""

from __future__ import annotations

import numpy as np


def liveness(chunk, C: int) -> np.ndarray:
    """(rows, C, fetched rows) bool: may query i of the chunk see fetched row j?"""
    R, before = chunk.old_positions.shape
    first = chunk.first
    old = chunk.old_positions.copy()
    had_dead = chunk.dead is not None
    if had_dead:
        old[np.arange(R), chunk.dead] = first  # the first new token took the dead slot
    appended = np.arange(first + had_dead, first + C)
    positions = np.concatenate([old, np.broadcast_to(appended, (R, appended.size))], axis=1)
    # step at which each fetched row's token was evicted (C: not evicted in this chunk)
    order = np.argsort(positions, axis=1)
    sorted_positions = np.take_along_axis(positions, order, axis=1)
    evicted_at = np.full(positions.shape, C, np.int64)
    step_rows, steps = np.nonzero(chunk.evicted >= 0)
    stride = first + C + 1  # offsetting each row by this keeps the flattened rows sorted
    offsets = np.arange(R)[:, None] * stride
    found = np.searchsorted(
        (sorted_positions + offsets).ravel(), chunk.evicted[step_rows, steps] + step_rows * stride
    )
    evicted_at[step_rows, order[step_rows, found - step_rows * positions.shape[1]]] = steps
    query_positions = first + np.arange(C)[None, :, None]
    return (positions[:, None, :] <= query_positions) & (
        evicted_at[:, None, :] >= np.arange(C)[None, :, None]
    )
