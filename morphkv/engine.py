"""The selection engine: decides, token by token, which stored slot each rule evicts.

It runs in NumPy on the host, over every (batch row, KV head) pair at once. Slots are the rows
of the cache's storage: a new token is written into the slot evicted one step earlier (the
"dead" slot), or appended while the cache is below its budget, so the engine's slot layout is
the storage layout. A chunk of tokens is processed with the same per-token steps as single
tokens, so any chunking of a stream makes identical decisions.

Attention rules keep a ring of the last ``window`` queries (``groups`` query heads per KV
head; the keys themselves in proxy scoring) with their softmax numerators against every
stored slot and the numerators' sums: each step adds one row (the new queries against the
stored keys) and one column (the window's queries against the new key, replacing the evicted
token's), O(slots * head_dim) work, and the rule reads probabilities off the ring.
Logits are float64 dot products of the stored keys (exact products, so the order of summation
does not change a decision in practice), then scaled by ``1/sqrt(head_dim)``.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .config import KVCacheConfig
from .rules import make_rule


class _OneBlasThread:
    """Context in which NumPy's bundled OpenBLAS uses one thread. The engine's host matmuls
    are small; with that thread pool running beside MLX's they stalled decoding for up to
    seconds per token on a 2-core machine (measured). Restores the caller's setting."""

    def __init__(self) -> None:
        self.get = self.set = None
        for lib in (Path(np.__file__).parent.parent / "numpy.libs").glob("libscipy_openblas*"):
            try:
                handle = ctypes.CDLL(str(lib))
                self.get = handle.scipy_openblas_get_num_threads64_
                self.set = handle.scipy_openblas_set_num_threads64_
            except (OSError, AttributeError):
                continue
            break

    def __enter__(self) -> None:
        if self.set is not None:
            self.previous = self.get()
            self.set(1)

    def __exit__(self, *exc) -> None:
        if self.set is not None:
            self.set(self.previous)


_one_blas_thread = _OneBlasThread()

TIE_RTOL = 1e-9  # scores this close (relative) to the minimum count as tied; oldest goes


def _clean(xp, logits):
    """NaN logits become -inf (zero attention); +inf becomes the largest finite float."""
    top = float(np.finfo(np.float64 if xp is np else np.float32).max)
    return xp.nan_to_num(logits, nan=-np.inf, posinf=top, neginf=-np.inf)


def _array_module(xp) -> tuple[Any, Any, int, float]:
    """(float dtype, int dtype, largest int, largest safe exponent) for array module ``xp``."""
    if xp is np:
        return np.float64, np.int64, np.iinfo(np.int64).max, 700.0
    return mx.float32, mx.int32, np.iinfo(np.int32).max, 80.0


class Engine:
    """Per-layer selection state for ``rows`` = batch * KV heads independent sequences.

    Arrays live in ``xp``: NumPy on the host (float64, the default), or ``mlx.core`` (float32)
    for single-token decode steps on a GPU, where the host must not wait for the device.
    ``to(xp)`` moves the state between the two."""

    ARRAYS = (
        "positions",
        "accumulated",
        "keys",
        "ring_queries",
        "ring_weights",
        "ring_shift",
        "ring_total",
        "dead",
        "_row",
    )

    def __init__(self, config: KVCacheConfig, rows: int, head_dim: int) -> None:
        self.config = config
        self.rule = make_rule(config)
        self.rows = rows
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim or head_dim)
        self.on_device = False  # arrays in mlx.core (True) or NumPy (False)
        self.float, self.int, self.no_position, self.max_exponent = _array_module(np)
        self.seen = 0  # tokens fed; the next token's absolute position
        self.slots = 0  # slots in use, the dead one included
        self.dead = None  # (rows,) slot evicted by the last step, or None
        self.groups = 0  # query heads per KV head; set by the first feed
        self.finite = True  # no NaN/inf key or query seen yet: logits need no cleaning
        self._row = np.arange(rows)
        self._head = -1  # ring row of the newest query
        self.capacity = 0
        self.positions = np.full((rows, 0), -1, np.int64)
        self.accumulated = np.zeros((rows, 0))
        if self.rule.attention:
            self.keys = np.zeros((rows, 0, head_dim))

    @property
    def xp(self):
        """The array module of the engine's state: numpy or mlx.core."""
        return mx if self.on_device else np

    def to(self, xp) -> Engine:
        """Move every array to array module ``xp`` (numpy or mlx.core); returns self."""
        if (xp is mx) == self.on_device:
            return self
        self.float, self.int, self.no_position, self.max_exponent = _array_module(xp)
        for name in self.ARRAYS:
            a = getattr(self, name, None)
            if a is None:
                continue
            if xp is np:
                a = np.array(a)
                a = a.astype(np.int64 if a.dtype.kind in "iu" else np.float64)
            else:
                a = mx.array(a, dtype=self.int if a.dtype.kind in "iu" else self.float)
            setattr(self, name, a)
        self.on_device = xp is mx
        if xp is not np:
            self.finite = False  # the device cannot promise finiteness without a sync
        return self

    # ---- storage -------------------------------------------------------------------------
    def _start_ring(self, groups: int) -> None:
        R, W, D, xp = self.rows, self.config.window, self.head_dim, self.xp
        self.groups = groups
        if self.rule.attention:
            self.ring_queries = xp.zeros((R, W, groups, D), dtype=self.float)
            # softmax numerators exp(logit - shift) per ring query and slot, kept up to date
            # column by column, with their shifts (row max when the row was made) and sums
            self.ring_weights = xp.zeros((R, W, groups, self.capacity), dtype=self.float)
            self.ring_shift = xp.zeros((R, W, groups), dtype=self.float)
            self.ring_total = xp.zeros((R, W, groups), dtype=self.float)

    def _grow(self, needed: int) -> None:
        """Widen the slot arrays (below the budget only: at the budget slots are reused)."""
        limit = self.config.budget + 1 if self.rule.evicts else needed
        capacity = max(needed, min(max(2 * self.capacity, 64), limit))
        pad = capacity - self.capacity

        def widen(a, axis: int, fill: float):
            width = [(0, 0)] * a.ndim
            width[axis] = (0, pad)
            return self.xp.pad(a, width, constant_values=fill)

        self.positions = widen(self.positions, 1, -1)
        self.accumulated = widen(self.accumulated, 1, 0.0)
        if self.rule.attention:
            self.keys = widen(self.keys, 1, 0.0)
            self.ring_weights = widen(self.ring_weights, 3, 0.0)
        self.capacity = capacity

    # ---- what rules read -----------------------------------------------------------------
    @property
    def kept(self) -> int:
        """Live tokens per row (slots minus the dead one)."""
        return self.slots - (self.dead is not None)

    @property
    def stored_positions(self) -> np.ndarray:
        """(rows, slots) absolute position held by each slot."""
        return self.positions[:, : self.slots]

    def newest_probs(self):
        """(rows, groups, slots) attention of the newest token's queries over the slots."""
        total = self._nonzero(self.ring_total[:, self._head, :, None])
        return self.ring_weights[:, self._head, :, : self.slots] / total

    def window_weights(self):
        """Softmax numerators (rows, window, groups, slots) of the last ``window`` tokens'
        queries and their sums (rows, window, groups): probabilities are their ratio."""
        rows = min(self.seen, self.config.window)
        total = self._nonzero(self.ring_total)
        if rows == self.config.window:
            return self.ring_weights[..., : self.slots], total
        ring = self.xp.array([(self._head - i) % self.config.window for i in range(rows)])
        return self.ring_weights[:, ring, :, : self.slots], total[:, ring]

    def _nonzero(self, total):
        """Sums of numerators; a row without a finite logit (all zero) divides by 1."""
        return total if self.finite else self.xp.where(total > 0, total, 1.0)

    # ---- feeding -------------------------------------------------------------------------
    def feed(self, keys, queries=None) -> np.ndarray | None:
        """Feed a chunk: keys (rows, C, D) in stream order, queries (rows, C, groups, D)
        (default: the keys, one group), arrays of ``self.xp``. On the host, returns (rows, C):
        the position each token's step evicted, -1 where none (None on the device)."""
        keys = self._as_float(keys)
        queries = keys[:, :, None] if queries is None else self._as_float(queries)
        if self.groups == 0:
            self._start_ring(queries.shape[2])
        elif queries.shape[2] != self.groups:
            raise ValueError(
                f"queries have {queries.shape[2]} heads per KV head, not {self.groups}"
            )
        host = self.xp is np
        if host and self.finite and self.rule.attention:
            self.finite = bool(np.isfinite(keys).all() and np.isfinite(queries).all())
        C = keys.shape[1]
        evicted = np.full((self.rows, C), -1, np.int64) if host else None
        with _one_blas_thread, np.errstate(invalid="ignore", over="ignore"):  # see _clean
            start = self._append_block(keys, queries) if self.dead is None else 0
            for i in range(start, C):
                self.step(keys[:, i], queries[:, i])
                if host and self.dead is not None:
                    evicted[:, i] = self.positions[self._row, self.dead]
        return evicted

    def _as_float(self, a):
        return np.asarray(a, np.float64) if self.xp is np else a.astype(self.float)

    def _append_block(self, keys: np.ndarray, queries: np.ndarray) -> int:
        """Append, in one go, the leading tokens that cause no eviction and need no per-token
        observation; return how many were taken. Rebuilding the ring costs a matmul over every
        slot, so a few tokens (a decode step) take the incremental per-token path instead."""
        C = keys.shape[1]
        if self.rule.observes:
            return 0  # the rule watches every token (h2o)
        room = C if not self.rule.evicts else max(0, self.config.budget - self.slots)
        n = min(C, room)
        if n == 0 or (self.rule.attention and n <= self.config.window):
            return 0
        start, end = self.slots, self.slots + n
        if end > self.capacity:
            self._grow(end)
        self.positions[:, start:end] = self.xp.arange(self.seen, self.seen + n)
        self.accumulated[:, start:end] = 0.0
        self.slots, self.seen = end, self.seen + n
        if self.rule.attention:
            R, W, G, D = self.ring_queries.shape
            self.keys[:, start:end] = keys[:, :n]
            for i in range(max(0, n - W), n):  # the ring holds the last W queries
                self._head = (self._head + 1) % W
                self.ring_queries[:, self._head] = queries[:, i]
            dots = self.ring_queries.reshape(R, W * G, D) @ self.keys[:, :end].transpose(0, 2, 1)
            logits = self._scaled(dots.reshape(R, W, G, end))
            self.ring_shift = self._peak(logits)
            weights = self.xp.exp(logits - self.ring_shift[..., None])
            self.ring_weights[..., :end] = weights
            self.ring_total = weights.sum(axis=-1)
        return n

    def step(self, key: np.ndarray, query: np.ndarray) -> None:
        """Append one token (key (rows, D), queries (rows, groups, D)); evict if over budget."""
        if self.dead is not None:
            slot = self.dead
        else:
            if self.slots == self.capacity:
                self._grow(self.slots + 1)
            slot = self.xp.full((self.rows,), self.slots, dtype=self.int)
            self.slots += 1
        n, r = self.slots, self._row
        self.positions[r, slot] = self.seen
        if self.rule.observes:
            self.accumulated[r, slot] = 0.0
        if self.rule.attention:
            R, W, G, D = self.ring_queries.shape
            self.keys[r, slot] = key
            # the window's queries against the new key: a new column of numerators
            column = self.ring_queries.reshape(R, W * G, D) @ key[:, :, None]
            column = self._scaled(column.reshape(R, W, G)) - self.ring_shift
            column = self.xp.exp(self.xp.minimum(column, self.max_exponent))
            self.ring_total = self.ring_total - self.ring_weights[r, :, :, slot] + column
            self.ring_weights[r, :, :, slot] = column
            # the new queries against every stored key: a new row, replacing the oldest
            self._head = h = (self._head + 1) % W
            self.ring_queries[:, h] = query
            row = self._scaled(query @ self.keys[:, :n].transpose(0, 2, 1))  # (R, G, n)
            self.ring_shift[:, h] = shift = self._peak(row)
            self.ring_weights[:, h, :, :n] = weights = self.xp.exp(row - shift[..., None])
            self.ring_total[:, h] = weights.sum(axis=-1)
        self.seen += 1
        self.rule.observe(self)
        self.dead = self._select() if self.rule.evicts and n > self.config.budget else None

    def _peak(self, logits):
        """Row max of the logits (0 for a row without a finite logit)."""
        peak = logits.max(axis=-1)
        return peak if self.finite else self.xp.where(self.xp.isfinite(peak), peak, 0.0)

    def _scaled(self, dots):
        """Logits from dot products (finite keys give finite float64 dot products)."""
        return dots * self.scale if self.finite else _clean(self.xp, dots * self.scale)

    def _select(self) -> np.ndarray:
        """Slot to evict per row: lowest score among unprotected slots, ties to the oldest.
        Scores are >= 0, so the relative tie tolerance needs no sign handling."""
        positions = self.stored_positions
        newest = self.seen - 1
        protected = (positions < self.config.n_sink) | (positions > newest - self.config.window)
        xp = self.xp
        scores = xp.where(protected, np.inf, self.rule.score(self))
        tied = scores <= scores.min(axis=1, keepdims=True) * (1.0 + TIE_RTOL)
        return xp.where(tied, positions, self.no_position).argmin(axis=1)

    # ---- persistence ---------------------------------------------------------------------
    HOST_ARRAYS = (
        "positions",
        "accumulated",
        "ring_queries",
        "ring_weights",
        "ring_shift",
        "ring_total",
    )
    INTEGER_ARRAYS = ("positions", "scalars", "dead")

    def state(self) -> dict[str, np.ndarray]:
        """Host arrays to save; the key mirror is rebuilt from the stored keys."""
        self.to(np)
        out = {k: getattr(self, k) for k in self.HOST_ARRAYS if hasattr(self, k)}
        out["scalars"] = np.array(
            [self.seen, self.slots, self._head, self.finite, self.groups], np.int64
        )
        out["dead"] = (
            self.dead.astype(np.int64)
            if self.dead is not None
            else np.full(self.rows, -1, np.int64)
        )
        return out

    @classmethod
    def from_state(
        cls, config: KVCacheConfig, rows: int, head_dim: int, saved: dict, keys: np.ndarray
    ) -> Engine:
        """Rebuild from ``state()`` and the stored keys (rows, slots, head_dim)."""
        engine = cls(config, rows, head_dim)
        seen, slots, head, finite, groups = (int(x) for x in saved["scalars"])
        engine.seen, engine.slots, engine._head, engine.finite = seen, slots, head, bool(finite)
        engine.groups = groups
        dead = saved["dead"].astype(np.int64)
        engine.dead = None if (dead < 0).all() else dead
        for name in cls.HOST_ARRAYS:
            if name in saved:
                setattr(engine, name, saved[name].copy())
        engine.capacity = engine.positions.shape[1]
        if engine.rule.attention:
            engine.keys = np.zeros((rows, engine.capacity, head_dim))
            engine.keys[:, :slots] = keys[:, :slots]
        return engine
