"""BatchMorphKVCache: mlx_lm's batch-cache protocol over the host path every morphkv cache runs.

``mlx_lm.batch_generate``, ``BatchGenerator`` and the server's continuous batching build a
batched cache with ``caches[0][i].merge([...])`` and then drive it like ``BatchKVCache``:
left-padded history, right-padded prompts (``prepare(lengths=, right_padding=)`` ...
``finalize()``), per-row RoPE offsets, rows leaving (``filter``), joining (``extend``) and
handed back as single-sequence caches (``extract``).

It is ``MorphKVCache``'s host path (``morphkv.core.feed``: one storage, one feed) with one
engine per row instead of one for all rows: rows differ in length, so their eviction points
differ. A decode step is a constant number of MLX operations whatever B: one scatter writes
every row's new token at its row's next slot, one slice is what attention reads, a (B, 1, 1, L)
mask hides each row's free tail (``morphkv.core.masks``); an eviction moves every evicting
row's slots with one take and one put. So every row keeps exactly what a single-sequence run
of the same tokens keeps.
"""

from __future__ import annotations

import copy
import dataclasses

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from . import quant, storage
from .engine import Engine
from .feed import Feed, no_reader
from .masks import offsets
from .pins import Pins, keep_bounded, repinned

_SHARED = (int, float, bool, str, type(None))
ROW_LISTS = ("seen", "stored", "waiting", "lead", "pin_next", "row_pins")  # one entry a row


class BatchMorphKVCache(Feed, quant.QuantizedBits, mlx_cache._BaseCache):
    """A batch of MorphKV rows over one shared storage (see the module docstring)."""

    def __init__(self, config, rows: int, row_class: type):
        # the batch runs the host engine (its rows' caches too: see MorphKVCache.on_host)
        self.init_feed(dataclasses.replace(config, engine="host"), rows, 1)
        self.row_class = row_class
        self.row_pins = [Pins() for _ in range(rows)]  # each row's own (``pins_of``)

    @property
    def B(self) -> int:
        return len(self.engines)

    # ---- building -------------------------------------------------------------------------
    @classmethod
    def merge(cls, caches, row_class: type) -> BatchMorphKVCache:
        """One batched cache from single-sequence caches of ``row_class`` (``MorphKVCache``,
        whose own ``merge`` calls this; history allowed). The inputs are copied, never updated
        (``batch_generate``'s contract)."""
        cls.check_rows(caches, row_class)
        batch = cls(caches[0].config, len(caches), row_class)
        batch.row_pins = [c.pins.copy() for c in caches]  # pinned ahead too (empty caches)
        batch.pin_next = [c.pin_next[0] for c in caches]
        full = [c for c in caches if not c.empty()]
        for c in full:
            c.flush()  # hands a pending update to the engine before copying
        if full:
            n = storage.capacity(max(c.engine.slots for c in full), batch.config, batch.evicts)
            batch.keys = storage.zeros(full[0].keys, len(caches), n)
            batch.values = storage.zeros(full[0].values, len(caches), n)
        for i, c in enumerate(caches):
            if c.empty():
                continue
            n = c.engine.slots
            storage.put_row(batch.keys, i, c.keys, n)
            storage.put_row(batch.values, i, c.values, n)
            batch.engines[i] = batch.copy_engine(c.engine, batch.row_pins[i])
            batch.seen[i], batch.stored[i] = c.offset, n
        return batch

    @staticmethod
    def check_rows(caches, row_class: type) -> None:
        """Single-sequence caches of ``row_class``, of one config (else the error)."""
        for i, c in enumerate(caches):
            if not isinstance(c, row_class):
                raise TypeError(
                    f"cache {i} is a {type(c).__name__}; BatchMorphKVCache.merge needs MorphKVCache"
                )
            if not c.empty() and quant.dims(c.keys)[0] != 1:
                raise ValueError(
                    f"cache {i} holds a batch of {quant.dims(c.keys)[0]}; merge takes "
                    "single-sequence caches"
                )
        configs = {c.config for c in caches}
        if len(configs) > 1:
            raise ValueError("merge needs caches of one config; got " + ", ".join(
                sorted({c.config.describe() if hasattr(c.config, "describe") else repr(c.config)
                        for c in caches})))

    def extract(self, idx: int):
        """A copy of row ``idx`` as a single-sequence cache (the row keeps going)."""
        self.flush_chunk()
        self.catch_up([idx])
        cache = self.row_class(self.config)
        cache.pins, cache.pin_next = self.row_pins[idx].copy(), [self.pin_next[idx]]
        engine = self.engines[idx]
        if engine is None:
            return cache
        n = int(self.stored[idx])
        cache.adopt(self.copy_engine(engine, cache.pins), storage.row_copy(self.keys, idx, n),
                    storage.row_copy(self.values, idx, n))  # keeps the pins set above
        return cache

    def filter(self, batch_indices) -> None:
        """Keep only the given rows, in that order."""
        keep = [int(i) for i in (batch_indices.tolist() if hasattr(batch_indices, "tolist")
                                 else batch_indices)]
        self.flush_chunk()
        self.engines = [self.engines[i] for i in keep]
        for name in ROW_LISTS:
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        if self._remaining is not None:
            self._remaining = [self._remaining[i] for i in keep]
        self._trim_steps()
        rows = mx.array(np.asarray(keep, np.int32))
        self.steps = [q[rows] for q in self.steps] if keep else []
        self._last = self._seal = None
        if self.keys is not None:
            self.keys = storage.take_rows(self.keys, keep)
            self.values = storage.take_rows(self.values, keep)

    def check_extend(self, other) -> None:
        """``other`` can join these rows: the same class and config, both or neither mid-prompt
        (``TypeError`` / ``ValueError`` before anything changes)."""
        name = type(self).__name__
        if not isinstance(other, type(self)):
            raise TypeError(f"cannot extend a {name} with {type(other).__name__}")
        if other.config != self.config:
            raise ValueError(f"cannot extend a {name} with rows of another config")
        if (self._remaining is None) != (other._remaining is None) and self.B and other.B:
            raise ValueError("cannot extend while only one of the batches is mid-prompt")

    def extend(self, other: BatchMorphKVCache) -> None:
        """Append the rows of ``other``; the decode steps' queries are aligned on the newest
        step, zeros where a side has none."""
        self.check_extend(other)
        self.flush_chunk()
        other.flush_chunk()
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
        if other._remaining is not None or self._remaining is not None:
            mine = self._remaining if self._remaining is not None else [0] * B0
            theirs = other._remaining if other._remaining is not None else [0] * other.B
            self._remaining = mine + theirs
        self.engines = self.engines + other.engines
        for name in ROW_LISTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._last = self._seal = None
        keys, values = other.keys, other.values
        if self.keys is None and keys is not None:
            self.keys = storage.zeros(keys, B0, quant.dims(keys)[2])
            self.values = storage.zeros(values, B0, quant.dims(values)[2])
        if self.keys is not None and keys is None:
            keys = storage.zeros(self.keys, other.B, quant.dims(self.keys)[2])
            values = storage.zeros(self.values, other.B, quant.dims(self.values)[2])
        if self.keys is not None:
            self.keys = storage.concat_rows(self.keys, keys) if B0 else keys
            self.values = storage.concat_rows(self.values, values) if B0 else values

    # ---- padding --------------------------------------------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """``left_padding``: leading columns of the next updates to skip per row.
        ``lengths``/``right_padding``: the next updates are right-padded prompts with
        ``lengths`` real tokens per row, until ``finalize``."""
        if left_padding is not None:
            pad = [int(p) for p in left_padding]
            if len(pad) != self.B or min(pad, default=0) < 0:
                raise ValueError(f"left_padding {left_padding} does not fit {self.B} rows")
            self.lead = [a + p for a, p in zip(self.lead, pad, strict=True)]
        if right_padding is not None and max(right_padding, default=0) > 0:
            if lengths is None or len(lengths) != self.B:
                raise ValueError("prepare(right_padding=...) needs lengths, one per row")
            self._remaining = [int(n) for n in lengths]

    def finalize(self) -> None:
        """End of a right-padded prompt (the padding was never stored)."""
        self._remaining = None

    # ---- mlx_lm hot path ------------------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        """Per-row RoPE offset of the next chunk's first column."""
        return offsets(np.subtract(self.seen, self.lead))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store each row's real tokens after its live slots; return every row's slots up to
        the longest row (the mask hides each row's free tail)."""
        C = keys.shape[2]
        if self.pin_prompts and C and (C > 1 or any(self.pin_next)):  # pin="prompt", per row
            self.check(keys, values)  # first: a refused update pins nothing
            self.pin_arrived(list(self.seen), self.spans(C)[1], C)
        return self.host_update(keys, values)

    def pins_of(self, i: int) -> Pins:
        return self.row_pins[i]

    def pin_range(self, i: int, start: int, end: int) -> None:
        """Pin positions [start, end) of row i (``Feed.pin_arrived``), keeping its pins
        bounded (``core.pins.keep_bounded``: reads the row's kept positions past ``PRUNE_AT``
        ranges)."""
        pins, engine = self.row_pins[i], self.engines[i]
        pins.add(np.arange(start, end))
        if engine is not None:
            repinned(engine, keep_bounded(pins, lambda: self._held_positions(i), engine.seen))

    def _held_positions(self, i: int) -> np.ndarray:
        self.flush()
        return np.asarray(self.engines[i].stored_positions).reshape(-1)

    def prepare_attention(self, queries: mx.array, scale: float, mask):
        """Attention hook: keeps this layer's queries (one reference per decode step) and
        returns the mask: (B, 1, 1, L) for a decode step, each row's liveness for a chunk."""
        return self.host_attention(queries, scale)

    # ---- accounting and the rest of the protocol -------------------------------------------
    @property
    def state(self) -> list:
        """The shared keys and values (what ``mx.eval`` must compute); a batched cache is not
        saved as such: ``extract`` rows and save those."""
        if self.keys is None:
            return []
        return [*quant.parts(self.keys), *quant.parts(self.values)]

    @property
    def nbytes(self) -> int:
        """Storage + every row's selection state + the decode steps' queries held."""
        held = 0 if self.keys is None else quant.nbytes(self.keys) + quant.nbytes(self.values)
        engines = sum(e.nbytes for e in self.engines if e is not None)
        pins = sum(p.nbytes for p in self.row_pins)
        return held + engines + pins + sum(q.nbytes for q in self.steps)

    @property
    def tokens_kept(self) -> list[int]:
        self.flush_chunk()
        return [int(n) for n in self.settled()]

    @property
    def rows(self) -> list:
        """Every row as a single-sequence cache (copies; see ``extract``)."""
        return [self.extract(i) for i in range(self.B)]

    def size(self) -> int:
        return max(self.tokens_kept, default=0)

    def empty(self) -> bool:
        return all(e is None for e in self.engines)

    @staticmethod
    def copy_engine(engine: Engine, pins: Pins) -> Engine:
        """A copy of an engine that shares nothing mutable with it (NumPy arrays copied, lists
        copied, immutable fields and the frozen config shared, anything else deep-copied),
        ranking with ``pins`` and reading its keys only through ``settle``. Several times
        cheaper than ``copy.deepcopy``; rows are copied at every merge, extract and split."""
        new = copy.copy(engine)
        for name, value in vars(engine).items():
            if name == "stored_keys":
                value = None
            elif name == "pins":
                value = pins
            elif isinstance(value, np.ndarray):
                value = value.copy()
            elif isinstance(value, list):  # the pending queries: never written in place
                value = list(value)
            elif not isinstance(value, _SHARED) and name != "config":
                value = copy.deepcopy(value)
            setattr(new, name, value)
        new.stored_keys = no_reader
        return new

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        pins = [p.copy() for p in self.row_pins]
        for name, value in vars(self).items():
            if name == "engines":
                value = [None if e is None else self.copy_engine(e, p)
                         for e, p in zip(value, pins, strict=True)]
            elif name == "row_pins":
                value = pins
            elif name != "row_class":
                value = copy.deepcopy(value, memo)
            setattr(new, name, value)
        return new
