"""The selection engine: decides, token by token, which stored slot each rule evicts.

It runs in NumPy on the host, over every (batch row, KV head) pair at once. Slots are the rows
of the cache's storage: a new token is written into the slot evicted one step earlier (the
"dead" slot), or appended while the cache is below its budget, so the engine's slot layout is
the storage layout. A chunk of tokens is processed with the same per-token steps as single
tokens, so any chunking of a stream makes identical decisions.

Attention rules keep a ring of the last ``window`` queries and their logits against every
stored slot: each step adds one row (the new query against the stored keys) and one column
(the window's queries against the new key), O(slots * head_dim) work, and the rule re-reads
the ring. Logits are float64 dot products of the stored keys (exact products, so the order of
summation does not change a decision in practice), then scaled by ``1/sqrt(head_dim)``.
"""

from __future__ import annotations

import math

import numpy as np

from .config import KVCacheConfig
from .rules import make_rule

TIE_RTOL = 1e-9  # scores this close (relative) to the minimum count as tied; oldest goes
_NO_POSITION = np.iinfo(np.int64).max
_F64_MAX = np.finfo(np.float64).max


def _clean(logits: np.ndarray) -> np.ndarray:
    """NaN logits become -inf (zero attention); +inf becomes the largest finite float."""
    return np.nan_to_num(logits, nan=-np.inf, posinf=_F64_MAX, neginf=-np.inf)


class Engine:
    """Per-layer selection state for ``rows`` = batch * KV heads independent sequences."""

    def __init__(self, config: KVCacheConfig, rows: int, head_dim: int) -> None:
        self.config = config
        self.rule = make_rule(config)
        self.rows = rows
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim or head_dim)
        self.seen = 0  # tokens fed; the next token's absolute position
        self.slots = 0  # slots in use, the dead one included
        self.dead: np.ndarray | None = None  # (rows,) slot evicted by the last step
        self._row = np.arange(rows)
        self._head = -1  # ring row of the newest query
        self.finite = True  # no NaN/inf key or query seen yet: logits need no cleaning
        self._alloc(0)

    # ---- storage -------------------------------------------------------------------------
    def _alloc(self, capacity: int) -> None:
        R, W, D = self.rows, self.config.window, self.head_dim
        self.capacity = capacity
        self.positions = np.full((R, capacity), -1, np.int64)
        self.accumulated = np.zeros((R, capacity))
        if self.rule.attention:
            self.keys = np.zeros((R, capacity, D))
            self.ring_logits = np.full((R, W, capacity), -np.inf)
            self.ring_queries = np.zeros((R, W, D))

    def _grow(self, needed: int) -> None:
        """Widen the slot arrays (below the budget only: at the budget slots are reused)."""
        limit = self.config.budget + 1 if self.rule.evicts else needed
        capacity = max(needed, min(max(2 * self.capacity, 64), limit))
        pad = capacity - self.capacity

        def widen(a: np.ndarray, axis: int, fill: float) -> np.ndarray:
            width = [(0, 0)] * a.ndim
            width[axis] = (0, pad)
            return np.pad(a, width, constant_values=fill)

        self.positions = widen(self.positions, 1, -1)
        self.accumulated = widen(self.accumulated, 1, 0.0)
        if self.rule.attention:
            self.keys = widen(self.keys, 1, 0.0)
            self.ring_logits = widen(self.ring_logits, 2, -np.inf)
        self.capacity = capacity

    # ---- what rules read -----------------------------------------------------------------
    @property
    def kept(self) -> int:
        """Live tokens per row (slots minus the dead one)."""
        return self.slots - (self.dead is not None)

    def newest_logits(self) -> np.ndarray:
        return self.ring_logits[:, self._head, : self.slots]

    def window_logits(self) -> np.ndarray:
        rows = min(self.seen, self.config.window)
        if rows == self.config.window:
            return self.ring_logits[:, :, : self.slots]
        ring = [(self._head - i) % self.config.window for i in range(rows)]
        return self.ring_logits[:, ring, : self.slots]

    # ---- feeding -------------------------------------------------------------------------
    def feed(self, keys: np.ndarray, queries: np.ndarray | None = None) -> None:
        """Feed a chunk: keys (rows, C, D) in stream order; queries default to the keys."""
        queries = keys if queries is None else queries
        keys = np.asarray(keys, np.float64)
        queries = np.asarray(queries, np.float64)
        if self.finite and self.rule.attention:
            self.finite = bool(np.isfinite(keys).all() and np.isfinite(queries).all())
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite keys: see _clean
            start = self._append_block(keys, queries) if self.dead is None else 0
            for i in range(start, keys.shape[1]):
                self.step(keys[:, i], queries[:, i])

    def _append_block(self, keys: np.ndarray, queries: np.ndarray) -> int:
        """Append, in one go, the leading tokens that cause no eviction and need no per-token
        observation; return how many were taken."""
        C = keys.shape[1]
        if self.rule.observes:
            return 0  # the rule watches every token (h2o)
        room = C if not self.rule.evicts else max(0, self.config.budget - self.slots)
        n = min(C, room)
        if n == 0:
            return 0
        start, end = self.slots, self.slots + n
        if end > self.capacity:
            self._grow(end)
        self.positions[:, start:end] = np.arange(self.seen, self.seen + n)
        self.accumulated[:, start:end] = 0.0
        self.slots, self.seen = end, self.seen + n
        if self.rule.attention:
            W = self.config.window
            self.keys[:, start:end] = keys[:, :n]
            for i in range(max(0, n - W), n):  # the ring holds the last W queries
                self._head = (self._head + 1) % W
                self.ring_queries[:, self._head] = queries[:, i]
            logits = self.ring_queries @ self.keys[:, :end].transpose(0, 2, 1)
            self.ring_logits[:, :, :end] = self._scaled(logits)
        return n

    def step(self, key: np.ndarray, query: np.ndarray) -> None:
        """Append one token (key, query: (rows, D)) and evict if over budget."""
        if self.dead is not None:
            slot = self.dead
        else:
            if self.slots == self.capacity:
                self._grow(self.slots + 1)
            slot = np.full(self.rows, self.slots)
            self.slots += 1
        n, r = self.slots, self._row
        self.positions[r, slot] = self.seen
        self.accumulated[r, slot] = 0.0
        if self.rule.attention:
            self.keys[r, slot] = key
            column = self.ring_queries @ key[:, :, None]  # (rows, W, 1): window vs new key
            self.ring_logits[r, :, slot] = self._scaled(column[:, :, 0])
            self._head = (self._head + 1) % self.config.window
            self.ring_queries[:, self._head] = query
            row = self.keys[:, :n] @ query[:, :, None]
            self.ring_logits[:, self._head, :n] = self._scaled(row[:, :, 0])
        self.seen += 1
        self.rule.observe(self)
        self.dead = self._select() if self.rule.evicts and n > self.config.budget else None

    def _scaled(self, dots: np.ndarray) -> np.ndarray:
        """Logits from dot products (finite keys give finite float64 dot products)."""
        return dots * self.scale if self.finite else _clean(dots * self.scale)

    def _select(self) -> np.ndarray:
        """Slot to evict per row: lowest score among unprotected slots, ties to the oldest."""
        positions = self.positions[:, : self.slots]
        newest = self.seen - 1
        protected = (positions < self.config.n_sink) | (positions > newest - self.config.window)
        scores = self.rule.score(self)
        scores = np.where(protected, np.inf, scores)
        low = scores.min(axis=1, keepdims=True)
        tied = scores <= low + TIE_RTOL * np.abs(low)
        return np.where(tied, positions, _NO_POSITION).argmin(axis=1)

    # ---- persistence ---------------------------------------------------------------------
    DTYPES = {"positions": np.int64, "scalars": np.int64, "dead": np.int64}

    @staticmethod
    def saved_names(config: KVCacheConfig) -> list[str]:
        names = ["positions", "accumulated", "scalars", "dead"]
        if make_rule(config).attention:
            names += ["ring_logits", "ring_queries"]
        return names

    def state(self) -> dict:
        """Host arrays to save; the key mirror is rebuilt from the stored keys."""
        out = {k: getattr(self, k) for k in self.saved_names(self.config) if hasattr(self, k)}
        out["scalars"] = np.array([self.seen, self.slots, self._head, self.finite], np.int64)
        out["dead"] = self.dead if self.dead is not None else np.full(self.rows, -1, np.int64)
        return out

    @classmethod
    def from_state(
        cls, config: KVCacheConfig, rows: int, head_dim: int, saved: dict, keys: np.ndarray
    ) -> Engine:
        """Rebuild from ``state()`` and the stored keys (rows, slots, head_dim)."""
        engine = cls(config, rows, head_dim)
        engine.seen, engine.slots, engine._head, finite = (int(x) for x in saved["scalars"])
        engine.finite = bool(finite)
        dead = saved["dead"].astype(np.int64)
        engine.dead = None if (dead < 0).all() else dead
        for name in ("positions", "accumulated", "ring_logits", "ring_queries"):
            if name in saved:
                setattr(engine, name, saved[name].copy())
        engine.capacity = engine.positions.shape[1]
        if engine.rule.attention:
            engine.keys = np.zeros((rows, engine.capacity, head_dim))
            engine.keys[:, : engine.slots] = keys[:, : engine.slots]
        return engine
