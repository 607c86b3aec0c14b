"""Masks of the host path (``morphkv.core.feed``): which stored columns each row's queries see.

Rows are left-aligned: row i's live tokens are columns [0, n_i) of what attention reads, the
rest of the row is free and hidden. Counts are per engine (``per`` batch rows each: the
single-sequence cache has one engine over all its rows, the batch cache one per row). A
decode step's mask is (B, 1, 1, L); every layer of a step asks for the same one, so the last
one built is kept and handed out again (one small array per step, not per layer). A
multi-token chunk's mask is built on the host from each row's liveness (exact chunked
prefill) or its causal triangle (no attention hook).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

_LAST: dict = {}  # kind -> (key, array): the last mask / offset built


def _memo(kind: str, key: bytes, build):
    last = _LAST.get(kind)
    if last is not None and last[0] == key:
        return last[1]
    value = build()
    _LAST[kind] = (key, value)
    return value


def decode_mask(counts):
    """(B, 1, 1, L) mask for one new token per row, row i seeing its first ``counts[i]``
    columns (L = the largest); None when every row sees all L."""
    L = max(counts, default=1)
    if all(c == L for c in counts):
        return None
    counts = np.asarray(counts, np.int64)

    def build():
        return mx.array(np.arange(L)[None, :] < counts[:, None]).reshape(-1, 1, 1, L)

    return _memo("mask", counts.tobytes(), build)


def offsets(values: np.ndarray) -> mx.array:
    """Per-row RoPE offsets as an MLX array (the same one for every layer of a step)."""
    values = values.astype(np.int64)
    return _memo("offset", values.tobytes(), lambda: mx.array(values.astype(np.int32)))


def liveness(before: int, evicted: np.ndarray) -> np.ndarray:
    """Which stored rows each query of a multi-token chunk may see, for exact chunked prefill:
    what token-by-token feeding would store at its step (a token evicted at step i is still
    seen by query i: eviction follows the arriving token's attention),
    (rows, C, before + C) bool: may query i see fetched row j? Fetched rows are [the
    ``before`` rows stored before the chunk + the C chunk rows]; ``evicted`` (rows, before + C)
    is the step at which each row was evicted (C: not in this chunk)."""
    R, N = evicted.shape
    C = N - before
    arrival = np.concatenate([np.full(before, -1), np.arange(C)])  # step each row arrived
    steps = np.arange(C)[None, :, None]
    return (arrival[None, None, :] <= steps) & (evicted[:, None, :] >= steps)


@dataclass
class Chunk:
    """One multi-token update: where each row's real tokens sit, what it held before."""

    starts: np.ndarray  # (engines,) first real column of each engine's rows in the chunk
    counts: np.ndarray  # (engines,) real tokens of each engine's rows
    before: np.ndarray  # (engines,) slots each engine's rows held before the chunk
    width: int  # columns of the fetched keys
    queries: mx.array | None = None  # (B, n_heads, C, D) with attention scoring
    fed: bool = False
    evicted: dict | None = None  # engine -> (rows, before + count) step each was evicted

    def evicts_inside(self) -> bool:
        """Was any row evicted inside the chunk (else its attention is plainly causal)?"""
        return any((e < self.counts[i]).any() for i, e in (self.evicted or {}).items())


def causal_mask(chunk: Chunk, C: int, return_array: bool = False, per: int = 1):
    """Each row's causal mask over [its stored tokens + the chunk's] (B, 1, C, width), the same
    for every layer of a forward pass (kept and handed out again); "causal" when every row takes
    all C columns over equally many stored tokens."""
    uniform = (not chunk.starts.any() and (chunk.counts == C).all()
               and (chunk.before == chunk.before[0]).all())
    if uniform and not return_array:
        return "causal"
    key = b"".join(np.asarray(a, np.int64).tobytes()
                   for a in (chunk.starts, chunk.counts, chunk.before, [C, chunk.width]))
    return _memo("causal", key, lambda: chunk_mask(chunk, C, 1, 1, True, per))


def chunk_mask(chunk: Chunk, C: int, H: int, n_heads: int, grouped: bool,
               per: int = 1) -> mx.array:
    """(B, n_heads, C, width) mask (``grouped``: (B, H, C, width), as mlx_lm's quantized
    attention wants it): a row's real queries see what token-by-token feeding would have
    stored (its liveness), padding queries every column. ``per``: batch rows per engine."""
    E = len(chunk.counts)
    B = E * per
    mask = np.ones((E, per * H, C, chunk.width), bool)
    for i in np.nonzero(chunk.counts)[0]:
        s, c, b = int(chunk.starts[i]), int(chunk.counts[i]), int(chunk.before[i])
        mask[i, :, s : s + c] = False
        if chunk.evicted is not None and i in chunk.evicted:
            mask[i, :, s : s + c, : b + c] = liveness(b, chunk.evicted[i])
        else:  # causal over [its stored tokens + the chunk's]
            mask[i, :, s : s + c, : b + c] = np.tril(np.ones((c, b + c), bool), k=b)
    visible = mx.array(mask.reshape(B, H, C, chunk.width))
    if grouped or n_heads == H:
        return visible
    visible = mx.broadcast_to(visible[:, :, None], (B, H, n_heads // H, C, chunk.width))
    return visible.reshape(B, n_heads, C, chunk.width)
