"""Slot storage of ``MorphKVCache``: where each token's keys and values live.

Storage is (B, n_kv_heads, slots, head_dim) per K and V, in the arriving dtype or as mlx_lm's
quantized triplets (``morphkv.core.quant``). A new token is written into the slot its row evicted
one step earlier (in place, ``put_along_axis``), or appended below the budget; after a
multi-token chunk the rows are gathered once into the engine's slot layout.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import quant


def to_numpy(x: mx.array) -> np.ndarray:
    """Host view for the selection engine (float16/float32 exactly; bfloat16 via float32)."""
    if x.dtype not in (mx.float16, mx.float32):
        x = x.astype(mx.float32)
    return np.asarray(x)


class SlotStorage:
    """The storage half of ``MorphKVCache`` (it reads ``keys``, ``values``, ``config`` and
    ``engine`` of the cache)."""

    def _place(self, keys: mx.array, values: mx.array, dead: np.ndarray | None) -> int:
        """Write the new tokens: the first into the dead slot (if any), the rest appended.
        Returns the number of rows that now hold tokens."""
        B, H, C = quant.dims(keys)
        start = self.engine.slots
        if dead is not None:
            if isinstance(dead, mx.array):  # device decode: no host sync
                slot = dead.reshape(B, H, 1, 1).astype(mx.int32)
            else:
                slot = mx.array(dead.reshape(B, H, 1, 1).astype(np.int32, copy=False))
            if C > 1:
                first_k, first_v = (quant.apply(lambda p: p[:, :, :1], x) for x in (keys, values))
                keys, values = (quant.apply(lambda p: p[:, :, 1:], x) for x in (keys, values))
            else:
                first_k, first_v = keys, values

            def put(stored, new):
                return mx.put_along_axis(stored, slot, new, axis=2)

            self.keys = quant.apply(put, self.keys, first_k)
            self.values = quant.apply(put, self.values, first_v)
            C -= 1
            if C == 0:
                return start
        end = start + C
        if self.keys is None or end > quant.dims(self.keys)[2]:
            self._reserve(end, keys, values)
        quant.assign(self.keys, start, end, keys)
        quant.assign(self.values, start, end, values)
        return end

    def _reserve(self, rows: int, keys: mx.array, values: mx.array) -> None:
        """Grow storage to hold ``rows`` rows (in steps of 256, never past budget + 1
        unless a chunk itself needs more)."""
        step = 256
        capacity = -(-rows // step) * step
        if self.config.method != "full":
            capacity = max(rows, min(capacity, self.config.budget + 1))
        used = 0 if self.keys is None else self.engine.slots

        def grow(old, fresh):
            return mx.concatenate([old[:, :, :used], fresh], 2)

        grown = []
        for old, new in ((self.keys, keys), (self.values, values)):
            fresh = quant.zeros(new, capacity - used)
            grown.append(fresh if old is None else quant.apply(grow, old, fresh))
        self.keys, self.values = grown

    def _fetch(self, rows: int | None = None) -> tuple[mx.array, mx.array]:
        rows = self.engine.slots if rows is None else rows
        if rows == quant.dims(self.keys)[2]:
            return self.keys, self.values
        return tuple(quant.apply(lambda p: p[:, :, :rows], x) for x in (self.keys, self.values))

    def _store_form(self, x: mx.array) -> quant.Storage:
        """New keys or values as the storage holds them."""
        if self.config.kv_bits is None:
            return x
        return quant.quantize(x, self.config.kv_group_size, self.config.kv_bits)

    def _host(self, x: quant.Storage) -> np.ndarray:
        """Stored keys or values as a host float array (dequantized when quantized)."""
        if self.config.kv_bits is None:
            return to_numpy(x)
        return quant.host_dequantize(x, self.config.kv_group_size, self.config.kv_bits)

    def _float(self, x: quant.Storage) -> mx.array:
        """Stored keys or values as a float array (dequantized when quantized)."""
        return quant.dequantize(x, self.config.kv_group_size, self.config.kv_bits)

    def _gather(self, source: mx.array, keys: quant.Storage, values: quant.Storage) -> tuple:
        def take(x):
            return mx.take_along_axis(x, source, axis=2)

        return quant.apply(take, keys), quant.apply(take, values)

    def _fetch_live(self) -> tuple[mx.array, mx.array]:
        """Stored keys/values without the slot awaiting reuse."""
        if self.engine.dead is None:
            return self._fetch()
        self.engine.to(np)
        B, H, _ = quant.dims(self.keys)
        live = np.ones((B * H, self.engine.slots), bool)
        live[np.arange(B * H), self.engine.dead] = False
        index = np.nonzero(live)[1].reshape(B, H, -1, 1).astype(np.int32)
        return self._gather(mx.array(index), *self._fetch())

    def _compact(self, fetched, dead, before: int, first: int) -> None:
        """Gather the engine's slot layout out of [old rows + chunk rows]."""
        engine = self.engine
        B, H, _ = quant.dims(self.keys)
        chunk_index = engine.positions[:, : engine.slots] - first  # < 0: stored before
        had_dead = dead is not None
        row = before + chunk_index - had_dead
        if had_dead:
            row = np.where(chunk_index == 0, dead[:, None], row)
        slot = np.arange(engine.slots)[None, :]
        source = np.where(chunk_index < 0, slot, row).reshape(B, H, -1, 1).astype(np.int32)
        self.keys, self.values = self._gather(mx.array(source), *fetched)
