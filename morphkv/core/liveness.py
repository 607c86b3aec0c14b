"""Which stored rows each query of a multi-token chunk may see, for exact chunked prefill.

Query i of a chunk sees exactly what would be stored had the chunk been fed one token at a
time: every token kept before the chunk that was not evicted before step i, and the chunk's
tokens up to i that were not evicted before step i (a token evicted at step i is still seen by
query i: eviction follows the arriving token's attention).
"""

from __future__ import annotations

import numpy as np


def liveness(before: int, evicted: np.ndarray) -> np.ndarray:
    """(rows, C, before + C) bool: may query i see fetched row j? Fetched rows are [the
    ``before`` rows stored before the chunk + the C chunk rows]; ``evicted`` (rows, before + C)
    is the step at which each row was evicted (C: not in this chunk)."""
    R, N = evicted.shape
    C = N - before
    arrival = np.concatenate([np.full(before, -1), np.arange(C)])  # step each row arrived
    steps = np.arange(C)[None, :, None]
    return (arrival[None, None, :] <= steps) & (evicted[:, None, :] >= steps)
