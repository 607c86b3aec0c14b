"""Masks of the batch caches: which columns each row's queries see.

Rows are left-aligned: row i's live tokens are columns [0, n_i) of what attention reads, the
rest of the row is free and hidden. A decode step's mask is (B, 1, 1, L); every layer of a
step asks for the same one, so the last one built is kept and handed out again (one small
array per step, not per layer); a multi-token chunk's is each row's causal triangle
(``morphkv.core.batch``, no attention hook).
"""

from __future__ import annotations

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


def causal_mask(starts, counts, before, width: int, C: int, return_array: bool = False):
    """Each row's causal mask over [its ``before`` kept tokens + its ``counts`` new ones, from
    column ``starts`` of the C] (B, 1, C, width), the same for every layer of a forward pass
    (kept and handed out again); padding queries see every column; "causal" when every row
    takes all C columns over equally many kept tokens."""
    if not starts.any() and (counts == C).all() and (before == before[0]).all() and \
            not return_array:
        return "causal"

    def build():
        mask = np.ones((len(counts), 1, C, width), bool)
        for i in np.nonzero(counts)[0]:
            s, c, b = int(starts[i]), int(counts[i]), int(before[i])
            mask[i, :, s : s + c] = False
            mask[i, :, s : s + c, : b + c] = np.tril(np.ones((c, b + c), bool), k=b)
        return mx.array(mask)

    key = b"".join(np.asarray(a, np.int64).tobytes() for a in (starts, counts, before, [C, width]))
    return _memo("causal", key, build)
