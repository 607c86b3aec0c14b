"""How ``BatchMorphKVCache`` hands tokens to its rows' engines.

Decode tokens wait (``BatchRows.waiting``) until their row reaches a point of its engine's
grid, or leaves, joins or is extracted; then ``catch_up`` hands them over one by one exactly as
a single-sequence ``MorphKVCache`` would have (``Engine.decode`` per token, ``Engine.settle``
when the engine asks for it), reading the shared storage on the host once for all those rows,
and the evicting rows' slot moves are applied together (``batch_storage.move_slots``). A
multi-token chunk is fed row by row through ``Engine.feed_chunk`` (``flush_chunk``), then the
storage is compacted with one gather for all rows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import batch_storage as bs
from . import quant
from .storage import to_numpy


class BatchFeed:
    """The feeding half of ``BatchMorphKVCache`` (reads ``BatchRows``' fields)."""

    def settle_due(self) -> None:
        """Hand over the waiting tokens of the rows whose newest token is on their grid."""
        due = self.due()
        if due.any():
            self.catch_up(np.nonzero(due)[0])

    def catch_up(self, rows) -> None:
        """Hand every waiting token of ``rows`` to its engine; apply the evictions."""
        rows = [int(i) for i in rows if self.waiting[i] > 0]
        if not rows:
            return
        longest = int(self.waiting[rows].max())
        if self.needs_queries and len(self.steps) < longest:
            raise RuntimeError("attention scoring: the cache was read before its queries came")
        queries = None
        if self.needs_queries:
            steps = self.steps[len(self.steps) - longest :]
            queries = steps[0] if longest == 1 else mx.concatenate(steps, axis=2)
            mx.eval(queries, *quant._parts(self.keys), *quant._parts(self.values))
            queries = to_numpy(queries)
        keys = values = None
        moves = []
        for i in rows:
            engine, w = self.engines[i], int(self.waiting[i])
            due = False
            for k in range(longest - w, longest):
                due = engine.decode(None if queries is None else queries[i : i + 1, :, k : k + 1])
            if due:
                if keys is None:
                    keys = bs.host(self.keys, self.config)
                    if self.config.morphkv_value:
                        values = bs.host(self.values, self.config)
                m = engine.settle(keys[i], None if values is None else values[i])
                if m is not None:
                    moves.append((i, m))
            self.waiting[i] = 0
            self.stored[i] = engine.slots
        self._trim_steps()
        if moves:
            H = quant.dims(self.keys)[1]
            block = moves[0][1][0].shape[1]
            src = np.zeros((self.B, H, block), np.int64)
            dst = np.zeros((self.B, H, block), np.int64)
            for i, (s, d) in moves:
                src[i], dst[i] = s, d
            self.keys = bs.move_slots(self.keys, src, dst)
            self.values = bs.move_slots(self.values, src, dst)

    def flush_chunk(self) -> None:
        """Feed the last multi-token chunk to the rows' engines (by the attention hook, with
        the chunk's queries, else at the next update or read) and compact the storage."""
        chunk = self._chunk
        if chunk is None or chunk.fed:
            return
        if chunk.queries is None and self.needs_queries:
            raise RuntimeError("attention scoring: the cache was read before its queries came")
        config = self.config
        rows = np.nonzero(chunk.counts)[0]
        # the chunk's rows are in the storage already: one evaluation, then host views
        reads = [bs.fetch(self.keys, chunk.width)]
        if config.morphkv_value:
            reads.append(bs.fetch(self.values, chunk.width))
        mx.eval(*[p for x in reads for p in quant._parts(x)],
                *([] if chunk.queries is None else [chunk.queries]))
        stored = bs.host(reads[0], config)
        stored_values = bs.host(reads[1], config) if config.morphkv_value else None
        queries = None if chunk.queries is None else to_numpy(chunk.queries)
        B, H = self.B, quant.dims(self.keys)[1]
        sources, chunk.evicted = {}, {}
        for i in rows:
            s, c, b = int(chunk.starts[i]), int(chunk.counts[i]), int(chunk.before[i])
            engine = self.engines[i]
            source, chunk.evicted[i] = engine.feed_chunk(
                stored[i][:, b : b + c],
                None if queries is None else queries[i : i + 1, :, s : s + c],
                None if stored_values is None else stored_values[i][:, b : b + c],
                stored[i][:, :b],
                None if stored_values is None else stored_values[i][:, :b],
            )
            n = source.shape[1]
            if n < b + c or (source != np.arange(n)).any():
                sources[i] = source
            self.stored[i] = engine.slots
        capacity = quant.dims(self.keys)[2]
        if self.evicts:  # back to budget + 1 slots once a long chunk is compacted
            capacity = max(self.capacity_floor(), int(self.stored.max(initial=0)))
        if sources or capacity != quant.dims(self.keys)[2]:
            index = np.minimum(np.arange(capacity), chunk.width - 1)
            index = np.broadcast_to(index, (B, H, capacity)).copy()
            for i, source in sources.items():
                index[i, :, : source.shape[1]] = source
            self.keys = bs.gather_slots(bs.fetch(self.keys, chunk.width), index)
            self.values = bs.gather_slots(bs.fetch(self.values, chunk.width), index)
        chunk.fed = True
        chunk.queries = None
        self._chunk = None
