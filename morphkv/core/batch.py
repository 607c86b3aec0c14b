"""mlx_lm's batch-cache protocol: what both batch caches share, and the row-wise batch.

``mlx_lm.batch_generate``, ``BatchGenerator`` and the server's continuous batching build a
batched cache with ``caches[0][i].merge([...])`` and then drive it like ``BatchKVCache``:
left-padded history, right-padded prompts (``prepare(lengths=, right_padding=)`` ...
``finalize()``), per-row RoPE offsets, rows leaving (``filter``), joining (``extend``) and
handed back as single-sequence caches (``extract``). ``BatchProtocol`` is that protocol's
bookkeeping; ``DeviceBatchCache`` (``morphkv.core.device_batch``) runs it over one storage for
rows scored by the model's real queries.

``BatchMorphKVCache`` holds every other batch (keys as proxy queries: a cache used without the
attention hook, the seed's API) as its rows' own ``MorphKVCache`` objects: each row's
real tokens go to its cache (``MorphKVCache.store``), so a row keeps exactly what the same
sequence run alone keeps, by construction. What attention reads is every row's [kept + new]
rows, padded to the longest; a row's kept count before an update follows from its position
(``settled``), so the mask is known before the update runs. With the hook each row attends
itself (``attend``), as one sequence does.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from . import quant, storage
from .device import next_eviction
from .feed import Feed
from .masks import causal_mask, decode_mask, offsets
from .pins import keep_bounded, repinned


class BatchProtocol(Feed, quant.QuantizedBits, mlx_cache._BaseCache):
    """mlx_lm's batch protocol: rows, padding, offsets, pins (see the module docstring)."""

    def prepare_attention(self, queries: mx.array, scale: float, mask):
        """Queries handed in without the hook's ``attend`` (benchmarks): attends now."""
        if self._held is not None:
            self.attend(queries, scale, mask)
        return mask

    def no_window(self, window_size: int | None) -> None:
        """Batches hold every layer's rows alike: a sliding-window layer keeps mlx_lm's cache."""
        if window_size is not None:
            raise NotImplementedError(
                f"{type(self).__name__} does not support sliding-window attention layers; "
                "keep mlx_lm's RotatingKVCache for those layers")

    @property
    def B(self) -> int:
        return len(self.engines)

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

    def _extend_remaining(self, other) -> None:
        if other._remaining is not None or self._remaining is not None:
            mine = self._remaining if self._remaining is not None else [0] * self.B
            theirs = other._remaining if other._remaining is not None else [0] * other.B
            self._remaining = mine + theirs

    @staticmethod
    def kept_rows(batch_indices) -> list[int]:
        return [int(i) for i in (batch_indices.tolist() if hasattr(batch_indices, "tolist")
                                 else batch_indices)]

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

    def advance(self, C: int) -> tuple[np.ndarray, np.ndarray]:
        """(starts, counts) of an update of C columns; the padding counters move past it."""
        starts, counts = self.spans(C)
        self.lead = np.subtract(self.lead, starts).tolist()
        if self._remaining is not None:
            self._remaining = np.subtract(self._remaining, counts).tolist()
        return starts, counts

    @property
    def offset(self) -> mx.array:
        """Per-row RoPE offset of the next chunk's first column."""
        return offsets(np.subtract(self.seen, self.lead))

    def pins_of(self, i: int):
        return self.row_pins[i]

    def pin_range(self, i: int, start: int, end: int) -> None:
        """Pin positions [start, end) of row i (``Feed.pin_arrived``), keeping its pins
        bounded (``core.pins.keep_bounded``: reads the row's kept positions past ``PRUNE_AT``
        ranges)."""
        pins, engine = self.row_pins[i], self.engines[i]
        pins.add(np.arange(start, end))
        if engine is not None:
            repinned(engine, keep_bounded(pins, lambda: self._held_positions(i), engine.seen))

    @property
    def rows(self) -> list:
        """Every row as a single-sequence cache (copies; see ``extract``)."""
        return [self.extract(i) for i in range(self.B)]

    def size(self) -> int:
        return max(self.tokens_kept, default=0)

    def empty(self) -> bool:
        return all(e is None for e in self.engines)


def settled(config, seen: int) -> int:
    """Slots a row holds after ``seen`` tokens once a due eviction has run: what the next
    update's attention reads before its own tokens (a function of the position alone)."""
    budget, block = config.budget, config.block
    if seen <= budget or not config.rule.evicts:
        return seen
    last = next_eviction(config, seen - block)  # the last eviction point before ``seen``
    return budget + 1 - block + (seen - 1 - last)


class BatchMorphKVCache(BatchProtocol):
    """A batch of ``MorphKVCache`` rows, each fed its own tokens (see the module docstring)."""

    def __init__(self, config, caches: list, row_class: type):
        self.config, self.caches, self.row_class = config, caches, row_class
        self.evicts, self.per, self._seal = config.rule.evicts, 1, None
        self.keys = self.values = None  # (``check``: the rows hold the storage)
        self.lead, self._remaining = [0] * len(caches), None
        self.pin_prompts = config.pin == "prompt"
        self.pin_next = [c.pin_next[0] for c in caches]
        self._held = None  # (starts, counts, Dv) of the update waiting for the hook's queries

    @property
    def engines(self) -> list:
        return [c.engine for c in self.caches]

    @property
    def seen(self) -> list[int]:
        return [c.offset for c in self.caches]

    @property
    def row_pins(self) -> list:
        return [c.pins for c in self.caches]

    def pin_range(self, i: int, start: int, end: int) -> None:
        self.caches[i].pin_range(0, start, end)  # the row's own ``pin``

    @classmethod
    def merge(cls, caches, row_class: type) -> BatchMorphKVCache:
        """One batch of copies of single-sequence caches (history allowed)."""
        cls.check_rows(caches, row_class)
        for c in caches:
            c._flush()  # a held update reaches the engine (lazily) before the copy
        return cls(caches[0].config, [copy.deepcopy(c) for c in caches], row_class)

    def extract(self, idx: int):
        """A copy of row ``idx`` as a single-sequence cache (the row keeps going)."""
        self._drop_held()
        row = self.caches[idx]
        row._flush()
        cache = copy.deepcopy(row)
        cache.pin_next = [self.pin_next[idx]]
        return cache

    def filter(self, batch_indices) -> None:
        """Keep only the given rows, in that order."""
        self._drop_held()
        keep = self.kept_rows(batch_indices)
        self.caches = [self.caches[i] for i in keep]
        self.lead = [self.lead[i] for i in keep]
        self.pin_next = [self.pin_next[i] for i in keep]
        if self._remaining is not None:
            self._remaining = [self._remaining[i] for i in keep]
        self._seal = None

    def extend(self, other: BatchMorphKVCache) -> None:
        """Append the rows of ``other``."""
        self.check_extend(other)
        self._drop_held()
        other._drop_held()
        self._extend_remaining(other)
        self.caches = self.caches + other.caches
        self.lead, self.pin_next = self.lead + other.lead, self.pin_next + other.pin_next
        self._seal = None

    def _drop_held(self) -> None:
        """Rows change: an update no attention came for is fed without (keys as proxies)."""
        self._held = None

    # ---- mlx_lm hot path ------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Each row's real tokens to its cache; returns every row's [kept + new] rows padded
        to the longest (``make_mask`` hides each row's tail)."""
        C = keys.shape[2]
        self.check(keys, values)  # first: a refused update changes nothing
        self._held = None
        if self.pin_prompts and C and (self.prompt(C) or any(self.pin_next)):
            self.pin_arrived(self.seen, self.spans(C)[1], C)
        starts, counts = self.advance(C)
        fetched = []
        for i, c in enumerate(self.caches):
            s, n = int(starts[i]), int(counts[i])
            if n:
                fetched.append(c.store(keys[i : i + 1, :, s : s + n],
                                       values[i : i + 1, :, s : s + n]))
            elif c.engine is not None:
                c._flush()
                fetched.append(c._fetch())
            else:
                fetched.append(tuple(storage.zeros(storage.store_form(x[:1, :, :1], self.config),
                                                   1, 0) for x in (keys, values)))
        L = max(max(quant.dims(k)[2] for k, _ in fetched), 1)
        self._held = (starts, counts, values.shape[-1])
        return tuple(storage.concat_rows_all([storage.grow(f[j], L) for f in fetched])
                     for j in (0, 1))

    def attend(self, queries, scale: float, mask=None, sinks=None):
        """The hook's attention: each row's cache attends its own tokens (as one sequence
        does); padding columns get zeros."""
        held, self._held = self._held, None
        if held is None:
            raise RuntimeError("BatchMorphKVCache.attend: no update is waiting for its queries")
        starts, counts, Dv = held
        B, n_heads, C, _ = queries.shape
        outs = []
        for i, c in enumerate(self.caches):
            s, n = int(starts[i]), int(counts[i])
            out = mx.zeros((1, n_heads, C, Dv), queries.dtype)
            if n:
                out[:, :, s : s + n] = c.attend(queries[i : i + 1, :, s : s + n], scale, None,
                                                sinks)
            outs.append(out)
        return outs[0] if B == 1 else mx.concatenate(outs, axis=0)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs):
        """Mask for N new columns over every row's [kept + new] rows (``update_and_fetch``)."""
        self.no_window(window_size)
        starts, counts = self.spans(N)
        before = np.array([settled(self.config, t) for t in self.seen], np.int64)
        width = max(int((before + counts).max(initial=0)), 1)
        if N == 1:
            return decode_mask(np.where(counts > 0, before + counts, width))
        return causal_mask(starts, counts, before, width, N, return_array)

    # ---- accounting -----------------------------------------------------------------------
    @property
    def state(self) -> list:
        """Every row's storage and engine arrays (what ``mx.eval`` must compute); a batch is
        not saved as such: ``extract`` rows and save those."""
        out = []
        for c in self.caches:
            if c.keys is not None:
                arrays = (getattr(c.engine, n) for n in c.engine.ARRAYS)
                out += [*quant.parts(c.keys), *quant.parts(c.values),
                        *(a for a in arrays if a is not None)]
        return out

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @property
    def tokens_kept(self) -> list[int]:
        return [c.tokens_kept for c in self.caches]
