"""BatchMorphKVCache: mlx_lm's batch-cache protocol over one shared storage for all rows.

``mlx_lm.batch_generate``, ``BatchGenerator`` and the server's continuous batching build a
batched cache with ``caches[0][i].merge([...])`` and then drive it like ``BatchKVCache``:
left-padded history, right-padded prompts (``prepare(lengths=, right_padding=)`` ...
``finalize()``), per-row RoPE offsets, rows leaving (``filter``), joining (``extend``) and
handed back as single-sequence caches (``extract``).

Design: one storage per K and V, (B, n_kv_heads, capacity, head_dim), rows left-aligned
(``morphkv.core.batch_storage``); each row keeps its own selection ``Engine`` (rows differ in
length, so their eviction points differ). A decode step is a constant number of MLX operations
whatever B: one scatter writes every row's new token at its row's next slot, one slice is what
attention reads, a (B, 1, 1, L) mask hides each row's free tail (``morphkv.core.batch_mask``).
Between a row's eviction points nothing per row runs: the step's queries are kept (one
reference per step) and per-row counters live in NumPy; a row's waiting tokens are handed to
its engine, token by token as a single-sequence ``MorphKVCache`` hands them (``decode``, then
``settle``), when the row reaches a point of the engine's grid (an eviction or a flush of its
pending rows), or when it leaves, joins, is extracted or takes a multi-token chunk. Evicting
rows move their slots with one gather and one scatter for all of them. So every row keeps
exactly what a single-sequence run of the same tokens keeps. Multi-token chunks (prefill) go
through each row's ``feed_chunk`` and the liveness mask, as ``MorphKVCache`` does.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from . import batch_storage as bs
from . import quant
from .batch_feed import BatchFeed
from .batch_mask import Chunk, causal_mask, chunk_mask, decode_mask, offsets
from .batch_rows import BatchRows


class BatchMorphKVCache(BatchFeed, BatchRows, quant.QuantizedBits, mlx_cache._BaseCache):
    """A batch of MorphKV rows over one shared storage (see the module docstring)."""

    # ---- building -------------------------------------------------------------------------
    @classmethod
    def merge(cls, caches, row_class: type) -> BatchMorphKVCache:
        """One batched cache from single-sequence caches of ``row_class`` (``MorphKVCache``,
        whose own ``merge`` calls this; history allowed). The inputs are copied, never updated
        (``batch_generate``'s contract)."""
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
        batch = cls(caches[0].config, len(caches), row_class)
        full = [c for c in caches if not c.empty()]
        for c in full:
            c.size()  # settles a pending update before copying
        if full:
            n = max(c.engine.slots for c in full)
            batch.keys = bs.zeros(full[0].keys, len(caches), max(n, batch.capacity_floor()))
            batch.values = bs.zeros(full[0].values, len(caches), max(n, batch.capacity_floor()))
        for i, c in enumerate(caches):
            if c.empty():
                continue
            n = c.engine.slots
            bs.put_row(batch.keys, i, c.keys, n)
            bs.put_row(batch.values, i, c.values, n)
            batch.engines[i] = batch.own(c.engine)
            batch.seen[i], batch.stored[i] = c.offset, n
        return batch

    def extract(self, idx: int):
        """A copy of row ``idx`` as a single-sequence cache (the row keeps going)."""
        self.flush_chunk()
        self.catch_up([idx])
        cache = self.row_class(self.config)
        engine = self.engines[idx]
        if engine is None:
            return cache
        n = int(self.stored[idx])
        cache.keys = bs.row_copy(self.keys, idx, n)
        cache.values = bs.row_copy(self.values, idx, n)
        cache.engine = self.copy_engine(engine)
        cache.engine.stored_keys = cache._host_keys
        cache.offset = int(self.seen[idx])
        return cache

    def filter(self, batch_indices) -> None:
        """Keep only the given rows, in that order."""
        keep = [int(i) for i in (batch_indices.tolist() if hasattr(batch_indices, "tolist")
                                 else batch_indices)]
        self.flush_chunk()
        self.take(keep)
        if self.keys is not None:
            self.keys, self.values = bs.take_rows(self.keys, keep), bs.take_rows(self.values, keep)

    def extend(self, other: BatchMorphKVCache) -> None:
        """Append the rows of ``other``."""
        if not isinstance(other, BatchMorphKVCache):
            raise TypeError(f"cannot extend a BatchMorphKVCache with {type(other).__name__}")
        if other.config != self.config:
            raise ValueError("cannot extend a BatchMorphKVCache with rows of another config")
        if (self._remaining is None) != (other._remaining is None) and self.B and other.B:
            raise ValueError("cannot extend while only one of the batches is mid-prompt")
        self.flush_chunk()
        other.flush_chunk()
        B0 = self.B
        self.join(other)
        if other.keys is None:
            other_keys = other_values = None
        else:
            other_keys, other_values = other.keys, other.values
        if self.keys is None and other_keys is not None:
            self.keys = bs.zeros(other_keys, B0, quant.dims(other_keys)[2])
            self.values = bs.zeros(other_values, B0, quant.dims(other_values)[2])
        if self.keys is not None and other_keys is None:
            other_keys = bs.zeros(self.keys, other.B, quant.dims(self.keys)[2])
            other_values = bs.zeros(self.values, other.B, quant.dims(self.values)[2])
        if self.keys is not None:
            self.keys = bs.concat_rows(self.keys, other_keys) if B0 else other_keys
            self.values = bs.concat_rows(self.values, other_values) if B0 else other_values

    # ---- padding --------------------------------------------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """``left_padding``: leading columns of the next updates to skip per row.
        ``lengths``/``right_padding``: the next updates are right-padded prompts with
        ``lengths`` real tokens per row, until ``finalize``."""
        if left_padding is not None:
            pad = np.asarray([int(p) for p in left_padding], np.int64)
            if len(pad) != self.B or pad.min(initial=0) < 0:
                raise ValueError(f"left_padding {left_padding} does not fit {self.B} rows")
            self.lead = self.lead + pad
        if right_padding is not None and max(right_padding, default=0) > 0:
            if lengths is None or len(lengths) != self.B:
                raise ValueError("prepare(right_padding=...) needs lengths, one per row")
            self._remaining = np.asarray([int(n) for n in lengths], np.int64)

    def finalize(self) -> None:
        """End of a right-padded prompt (the padding was never stored)."""
        self._remaining = None

    # ---- mlx_lm hot path ------------------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        """Per-row RoPE offset of the next chunk's first column."""
        return offsets(self.seen - self.lead)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store each row's real tokens after its live slots; return every row's slots up to
        the longest row (the mask hides each row's free tail)."""
        self.check(keys, values)
        self.flush_chunk()
        C = keys.shape[2]
        if C == 1 and self.plain_decode():
            self.settle_due()
            self.reserve(int(self.stored.max()) + 1, keys, values)
            self.start_rows(range(self.B), keys.shape[3])
            self.keys = bs.write_tokens(self.keys, self.stored, bs.store_form(keys, self.config))
            self.values = bs.write_tokens(self.values, self.stored,
                                          bs.store_form(values, self.config))
            self.stored += 1
            self.seen += 1
            self.waiting += 1
            self._queries_due = self.needs_queries
            n = int(self.stored.max())
            return bs.fetch(self.keys, n), bs.fetch(self.values, n)
        return self._chunk_update(keys, values)

    def _chunk_update(self, keys, values):
        self.catch_up(range(self.B))
        starts, counts = self.spans(keys.shape[2])
        before = self.stored.copy()
        width = max(int((before + counts).max(initial=0)), 1)
        self.reserve(width, keys, values)
        self.start_rows(np.nonzero(counts)[0], keys.shape[3])
        sk, sv = bs.store_form(keys, self.config), bs.store_form(values, self.config)
        for i in np.nonzero(counts)[0]:
            span = (int(starts[i]), int(counts[i]))
            bs.write_span(self.keys, int(i), int(before[i]), sk, span)
            bs.write_span(self.values, int(i), int(before[i]), sv, span)
        self.consume(starts, counts)
        self.seen += counts
        self.stored = before + counts
        self._chunk = Chunk(starts, counts, before, width)
        return bs.fetch(self.keys, width), bs.fetch(self.values, width)

    def prepare_attention(self, queries: mx.array, scale: float, mask):
        """Attention hook: keeps this layer's queries (one reference per decode step) and
        returns the mask: (B, 1, 1, L) for a decode step, each row's liveness for a chunk."""
        self.set_scale(float(scale))
        chunk = self._chunk
        if chunk is None:
            if self._queries_due:
                # a new array: mlx_lm's quantized attention scales its queries in place
                self.steps.append(mx.stop_gradient(queries) if self.config.kv_bits else queries)
                self._queries_due = False
            return decode_mask(self.stored)
        if not chunk.fed and self.needs_queries:
            chunk.queries = mx.stop_gradient(queries) if self.config.kv_bits else queries
        B, n_heads, C, _ = queries.shape
        if self.chunk_waits(chunk, C):  # nothing evicted inside it: causal, fed later
            return causal_mask(chunk, C)
        self.flush_chunk()
        H = quant.dims(self.keys)[1]
        return chunk_mask(chunk, C, H, n_heads, self.config.kv_bits is not None)

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs
    ):
        """Mask for N new columns, as mlx_lm builds it before the layers run (the attention
        hook hands each layer the same for a decode step, the rows' liveness for a chunk)."""
        if window_size is not None:
            raise NotImplementedError(
                "BatchMorphKVCache does not support sliding-window attention layers"
            )
        self.flush_chunk()
        if N == 1 and self.plain_decode():
            return decode_mask(self.settled() + 1)
        settled = self.settled()  # what the update's catch-up leaves
        starts, counts = self.spans(N)
        width = max(int((settled + counts).max(initial=0)), 1)
        if N == 1:
            return decode_mask(np.where(counts > 0, settled + counts, width))
        return causal_mask(Chunk(starts, counts, settled, width), N, return_array)

    # ---- accounting and the rest of the protocol -------------------------------------------
    @property
    def state(self) -> list:
        """The shared keys and values (what ``mx.eval`` must compute); a batched cache is not
        saved as such: ``extract`` rows and save those."""
        if self.keys is None:
            return []
        return [*quant._parts(self.keys), *quant._parts(self.values)]

    @property
    def nbytes(self) -> int:
        """Storage + every row's selection state + the decode steps' queries held."""
        storage = 0 if self.keys is None else quant.nbytes(self.keys) + quant.nbytes(self.values)
        return storage + self.rows_nbytes()

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

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in vars(self).items():
            if name == "engines":
                value = [None if e is None else self.copy_engine(e) for e in value]
            elif name != "row_class":
                value = copy.deepcopy(value, memo)
            setattr(new, name, value)
        return new
