"""The per-row bookkeeping of ``BatchMorphKVCache``: each row's engine and NumPy counters.

Counters, one entry per row: ``seen`` (tokens the row has taken: its RoPE position), ``stored``
(slots of the shared storage holding its tokens, waiting ones included), ``waiting`` (decode
tokens written to the storage but not yet handed to the row's engine; their queries are the
last ``waiting`` entries of ``steps``), ``lead`` (left-padding columns still to skip) and,
during a right-padded prompt, ``_remaining`` (real tokens left).
"""

from __future__ import annotations

import copy
import dataclasses

import mlx.core as mx
import numpy as np

from . import batch_storage as bs
from . import quant
from .config import KVCacheConfig
from .engine import Engine
from .rules import make_rule
from .storage import check_pair

DEFER_TOKENS = 64  # a chunk this short that evicts nothing is fed at the next update
_SHARED = (int, float, bool, str, type(None), KVCacheConfig)


def _ints(n: int) -> np.ndarray:
    return np.zeros(n, np.int64)


class BatchRows:
    """Rows of a batch: engines, counters, the decode steps' queries (see module docstring)."""

    def __init__(self, config, rows: int, row_class: type):
        # the batch runs the host engine (its rows' caches too: see MorphKVCache.on_host)
        self.config = dataclasses.replace(config, engine="host")
        self.row_class = row_class
        self.evicts = make_rule(config).evicts
        self.engines: list[Engine | None] = [None] * rows
        self.seen, self.stored, self.waiting, self.lead = (_ints(rows) for _ in range(4))
        self._remaining: np.ndarray | None = None
        self.steps: list[mx.array] = []  # each decode step's queries (B, n_heads, 1, D)
        self._queries_due = False  # a decode step waits for its queries
        self._chunk = None  # the last multi-token update, until its rows are fed
        self._scale: float | None = None
        self.keys = self.values = None

    @property
    def B(self) -> int:
        return len(self.engines)

    @property
    def needs_queries(self) -> bool:
        return self.config.scoring == "attention"

    def capacity_floor(self) -> int:
        """Slots of the storage once it exists: budget + 1 for an evicting rule."""
        return self.config.budget + 1 if self.evicts else 256

    # ---- engines --------------------------------------------------------------------------
    @staticmethod
    def copy_engine(engine: Engine) -> Engine:
        """A copy of an engine that shares nothing mutable with it (NumPy arrays copied, lists
        copied, immutable fields and the frozen config shared, anything else deep-copied),
        without its cache's key reader (set by the new owner). Several times cheaper than
        ``copy.deepcopy``; rows are copied at every extract and batch split."""
        new = copy.copy(engine)
        for name, value in vars(engine).items():
            if name == "stored_keys":
                value = None
            elif isinstance(value, np.ndarray):
                value = value.copy()
            elif isinstance(value, list):  # the pending queries: never written in place
                value = list(value)
            elif not isinstance(value, _SHARED):
                value = copy.deepcopy(value)
            setattr(new, name, value)
        return new

    def own(self, engine: Engine) -> Engine:
        engine = self.copy_engine(engine)
        engine.stored_keys = self._no_reader
        return engine

    @staticmethod
    def _no_reader():
        raise RuntimeError("a batch row's engine reads its keys only through settle")

    def start_rows(self, rows, head_dim: int) -> None:
        """Engines for the rows that get their first tokens now."""
        H = None
        for i in rows:
            if self.engines[i] is None:
                H = H or quant.dims(self.keys)[1]
                e = Engine(self.config, H, head_dim, self.needs_queries)
                e.stored_keys = self._no_reader
                if self._scale is not None:
                    e.scale = self._scale
                self.engines[i] = e

    def set_scale(self, scale: float) -> None:
        if scale != self._scale:
            self._scale = scale
            for e in self.engines:
                if e is not None:
                    e.scale = scale

    # ---- counters -------------------------------------------------------------------------
    def plain_decode(self) -> bool:
        """A one-token update takes one token for every row (no padding to skip)."""
        return not self.lead.any() and (self._remaining is None or bool(self._remaining.all()))

    def due(self) -> np.ndarray:
        """Rows whose newest token is on their engine's grid: it must see it before the next
        token (an eviction, or a flush of pending rows)."""
        block, budget = self.config.block, self.config.budget
        return (self.waiting > 0) & ((self.seen - 1 - budget) % block == 0)

    def settled(self) -> np.ndarray:
        """Slots each row holds once its waiting tokens are handed over (no sync)."""
        over = self.due() & (self.stored > self.config.budget) if self.evicts else False
        return np.where(over, self.stored - self.config.block, self.stored)

    def chunk_waits(self, chunk, C: int) -> bool:
        """May this chunk attend causally and reach the engines later (at the next update or
        read)? Yes when no row evicts inside it and it is short (its keys and queries are held
        until then: at most ``DEFER_TOKENS`` columns)."""
        if C > DEFER_TOKENS:
            return False
        if not self.evicts:
            return True
        return not ((chunk.before + chunk.counts > self.config.budget) & (chunk.counts > 0)).any()

    def spans(self, C: int) -> tuple[np.ndarray, np.ndarray]:
        """(first column, count) of each row's real tokens in a chunk of C columns."""
        starts = np.minimum(self.lead, C)
        counts = C - starts
        if self._remaining is not None:
            counts = np.clip(np.minimum(counts, self._remaining), 0, None)
        return starts, counts

    def consume(self, starts: np.ndarray, counts: np.ndarray) -> None:
        self.lead = self.lead - starts
        if self._remaining is not None:
            self._remaining = self._remaining - counts

    def reserve(self, slots: int, keys: mx.array, values: mx.array) -> None:
        """Storage for ``slots`` slots per row (created like the arriving keys/values)."""
        if self.keys is None:
            cap = max(slots, self.capacity_floor())
            self.keys = bs.zeros(bs.store_form(keys[:1, :, :1], self.config), self.B, cap)
            self.values = bs.zeros(bs.store_form(values[:1, :, :1], self.config), self.B, cap)
            return
        cap = quant.dims(self.keys)[2]
        if slots > cap:
            step = 256
            cap = max(slots, -(-slots // step) * step if not self.evicts else slots)
            self.keys, self.values = bs.grow(self.keys, cap), bs.grow(self.values, cap)

    def take(self, keep: list[int]) -> None:
        """Only the rows ``keep``, in that order (storage excepted)."""
        index = np.asarray(keep, np.int64)
        self.engines = [self.engines[i] for i in keep]
        for name in ("seen", "stored", "waiting", "lead"):
            setattr(self, name, getattr(self, name)[index])
        if self._remaining is not None:
            self._remaining = self._remaining[index]
        self._trim_steps()
        if self.steps and keep:
            rows = mx.array(index.astype(np.int32))
            self.steps = [q[rows] for q in self.steps]
        elif not keep:
            self.steps = []

    def join(self, other: BatchRows) -> None:
        """Append the rows of ``other`` (storage excepted): the decode steps' queries are
        aligned on the newest step, zeros where a side has none."""
        B0 = self.B
        self._trim_steps()
        other._trim_steps()
        n = max(len(self.steps), len(other.steps))
        if B0 == 0:
            self.steps = list(other.steps)
        elif other.B and n:
            like = (self.steps or other.steps)[-1]

            def side(steps, rows, j):
                k = j - (n - len(steps))
                return steps[k] if k >= 0 else mx.zeros((rows, *like.shape[1:]), like.dtype)

            self.steps = [mx.concatenate([side(self.steps, B0, j), side(other.steps, other.B, j)])
                          for j in range(n)]
        if other._remaining is not None:
            mine = self._remaining if self._remaining is not None else _ints(B0)
            self._remaining = np.concatenate([mine, other._remaining])
        elif self._remaining is not None:
            self._remaining = np.concatenate([self._remaining, _ints(other.B)])
        self.engines = self.engines + other.engines
        for name in ("seen", "stored", "waiting", "lead"):
            setattr(self, name, np.concatenate([getattr(self, name), getattr(other, name)]))

    def _trim_steps(self) -> None:
        """Forget the queries no row waits for."""
        keep = int(self.waiting.max(initial=0))
        if len(self.steps) > keep:
            self.steps = self.steps[len(self.steps) - keep :] if keep else []

    def rows_nbytes(self) -> int:
        engines = sum(e.nbytes for e in self.engines if e is not None)
        return engines + sum(q.nbytes for q in self.steps)

    # ---- input checks ---------------------------------------------------------------------
    def check(self, keys: mx.array, values: mx.array) -> None:
        """Reject malformed input before anything is changed."""
        check_pair(keys, values)
        if keys.shape[0] != self.B:
            raise ValueError(
                f"keys of shape {tuple(keys.shape)} do not match a batch of {self.B} rows"
            )
        if self.keys is None:
            return
        group = self.config.kv_group_size
        for name, new, old in (("keys", keys, self.keys), ("values", values, self.values)):
            H, D = quant.dims(old)[1], quant.head_dim(old, group)
            if (new.shape[1], new.shape[3]) != (H, D) or new.dtype != quant.dtype(old):
                raise ValueError(
                    f"{name} of shape {tuple(new.shape)} and dtype {new.dtype} do not match the "
                    f"cache: n_kv_heads {H}, head_dim {D}, dtype {quant.dtype(old)}"
                )
