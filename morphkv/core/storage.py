"""Slot storage of ``MorphKVCache``: where each token's keys and values live.

Storage is (B, n_kv_heads, slots, head_dim) per K and V, in the arriving dtype or as mlx_lm's
quantized triplets (``morphkv.core.quant``). The live tokens are the first ``slots`` rows (the
engine's slot layout); a new token is appended after them in place. An eviction moves at most
``block`` rows down into the evicted rows (``_move``); after a multi-token chunk the rows are
gathered once into the engine's slot layout.
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


def check_pair(keys: mx.array, values: mx.array) -> None:
    """Reject keys and values that are not a floating (batch, n_kv_heads, tokens, head_dim) pair
    agreeing on batch, heads and tokens (one line naming the problem)."""
    if keys.ndim != 4 or values.ndim != 4:
        raise ValueError(
            "keys and values must be (batch, n_kv_heads, tokens, head_dim); "
            f"got keys {tuple(keys.shape)} and values {tuple(values.shape)}"
        )
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)} disagree on "
            "batch, heads or tokens"
        )
    if not mx.issubdtype(keys.dtype, mx.floating):
        raise ValueError(f"keys must be floating point, got {keys.dtype}")


class SlotStorage:
    """The storage half of ``MorphKVCache`` (it reads ``keys``, ``values``, ``config`` and
    ``engine`` of the cache)."""

    def _place(self, keys: mx.array, values: mx.array) -> int:
        """Append the new tokens after the ``slots`` live rows (in place when the storage has
        room, as mlx_lm's caches write). Returns the number of rows that now hold tokens."""
        start = self.engine.slots
        if isinstance(keys, mx.array) and isinstance(self.keys, mx.array):  # plain storage
            end = start + keys.shape[2]
            if end > self.keys.shape[2]:
                self._reserve(end, keys, values)
            self.keys[:, :, start:end] = keys
            self.values[:, :, start:end] = values
            return end
        end = start + quant.dims(keys)[2]
        if self.keys is None or end > quant.dims(self.keys)[2]:
            self._reserve(end, keys, values)
        quant.assign(self.keys, start, end, keys)
        quant.assign(self.values, start, end, values)
        return end

    def _move(self, moves, token: tuple | None = None) -> None:
        """Apply an eviction's row moves (src, dst), each (rows, block): row dst = row src.
        ``token``: the keys and values (as stored) of the newest token when every source row
        holds it (block 1: the top row moves into the hole), written without reading them."""
        src, dst = moves
        B, H, _ = quant.dims(self.keys)
        dst = mx.array(dst.reshape(B, H, -1, 1).astype(np.int32))
        if token is not None:
            for name, rows in zip(("keys", "values"), token, strict=True):
                put = quant.apply(lambda x, t: mx.put_along_axis(x, dst, t, axis=2),
                                  getattr(self, name), rows)
                setattr(self, name, put)
            return
        src = mx.array(src.reshape(B, H, -1, 1).astype(np.int32))

        def move(x):
            return mx.put_along_axis(x, dst, mx.take_along_axis(x, src, axis=2), axis=2)

        self.keys = quant.apply(move, self.keys)
        self.values = quant.apply(move, self.values)

    def _reserve(self, rows: int, keys: mx.array, values: mx.array) -> None:
        """Grow storage to hold ``rows`` rows (in steps of 256, never past budget + 1
        unless a chunk itself needs more)."""
        step = 256
        capacity = -(-rows // step) * step
        if self.config.method != "full":
            capacity = max(rows, min(capacity, self.config.budget + 1))
        self._grow_to(capacity, keys, values)

    def _grow_to(self, capacity: int, keys, values) -> None:
        """Storage of ``capacity`` rows: the live ones kept, zeros shaped like ``keys`` /
        ``values`` after them."""
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
        if isinstance(self.keys, mx.array):  # plain storage
            if rows == self.keys.shape[2]:
                return self.keys, self.values
            return self.keys[:, :, :rows], self.values[:, :, :rows]
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

    def _compact(self, fetched, source: np.ndarray) -> None:
        """Gather the engine's slot layout out of the fetched [old rows + chunk rows]:
        ``source`` (rows, slots) is the fetched row each slot now holds. An evicting cache
        keeps ``budget + 1`` rows (the rows past ``slots`` are free)."""
        B, H, _ = quant.dims(self.keys)
        if self.engine.rule.evicts and source.shape[1] < self.config.budget + 1:  # room kept
            pad = self.config.budget + 1 - source.shape[1]
            source = np.pad(source, [(0, 0), (0, pad)])
        index = mx.array(source.reshape(B, H, -1, 1).astype(np.int32))

        def take(x):
            return mx.take_along_axis(x, index, axis=2)

        self.keys, self.values = (quant.apply(take, x) for x in fetched)
