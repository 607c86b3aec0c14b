"""Block eviction's small parts: the pending arrays' plumbing, value norms, the running score
a rule keeps (picking a block of victims and the row moves that compact the storage afterwards
are ``morphkv.core.kernels.pick`` / ``moves``)."""

from __future__ import annotations

import numpy as np


def nbytes_of(x) -> int:
    """Bytes of an array or a quantized triplet (0 for None)."""
    if x is None:
        return 0
    return sum(int(p.nbytes) for p in (x if isinstance(x, tuple) else (x,)))


def concat(arrays):
    """The arrays joined along axis 2 (one array: itself)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=2)


def cutter(x):
    """Slices [i, j) of axis 2 of an array (None stays None)."""
    if x is None:
        return lambda i, j: None
    return lambda i, j: x[:, :, i:j]


def norms_of(values) -> np.ndarray:
    """(rows, n) float16 norms of values (rows, n, Dv): float32, NaN as 0, capped at 65504."""
    v = values.astype(np.float32, copy=False)
    norms = np.sqrt((v * v).sum(axis=-1))
    return np.minimum(np.fmax(norms, 0.0), 65504.0).astype(np.float16)  # fmax: NaN -> 0


def running_kind(rule) -> tuple[str | None, float]:
    """('sum' | 'peak' | None, decay) of the running score a rule keeps per slot (what the
    rule declares: ``Rule.running``, ``Rule.decay``)."""
    return rule.running, (rule.decay if rule.running == "peak" else 1.0)


def update_running(acc, kind: str, decay: float, rows, s0: int, n: int) -> None:
    """Running scores ``acc`` (rows, >= n) over new attention rows (rows, P, n) in arrival
    order ('sum' or 'peak' with ``decay``); the new slots [s0, n) start at 0."""
    acc[:, s0:n] = 0.0
    if kind == "sum":
        if rows.dtype == np.float16:  # float16 sums are exact in float64: any order
            acc[:, :n] += rows.sum(axis=1, dtype=np.float64)
        else:
            for k in range(rows.shape[1]):
                acc[:, :n] += rows[:, k]
    elif decay == 1.0 and acc.dtype == np.float16 == rows.dtype:
        # rows are >= 0 and never NaN: float16 order is the order of the bit patterns
        bits = acc.view(np.uint16)
        np.maximum(bits[:, :n], rows.view(np.uint16).max(axis=1), out=bits[:, :n])
    elif decay == 1.0:  # a max is exact in any order
        np.maximum(acc[:, :n], rows.max(axis=1), out=acc[:, :n])
    else:
        for k in range(rows.shape[1]):
            acc[:, :n] = np.maximum(acc[:, :n] * decay, rows[:, k])


def finite(x) -> bool:
    """No NaN/inf in x (its float64 sum is finite: float16/32 inputs cannot overflow it)."""
    return bool(np.isfinite(x.sum(dtype=np.float64)))

