"""Quantized K/V storage: MLX affine quantization, stored as mlx_lm's ``QuantizedKVCache`` does.

A quantized storage array is a triplet ``(packed uint32, scales, biases)`` from ``mx.quantize``
over the last axis (head_dim), so every stored token row is quantized on its own: a row can be
written into any slot, and ``dequantize(quantize(x))`` of a token does not depend on its
neighbours (chunked and token-by-token feeding store the same bits). The helpers below apply
one operation to a plain array or to each part of a triplet, along the slot axis.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import mlx.core as mx

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)

Storage = mx.array | tuple  # a plain array, or (packed, scales, biases)


def scale_dtype(dtype):
    """The dtype of the scales and biases stored for keys arriving in ``dtype``: float16 for a
    float32 model (as a float16 model stores them: 4 bytes a group, not 8; an 8-bit step is
    far coarser than float16's rounding), else the arriving dtype."""
    return mx.float16 if dtype == mx.float32 else dtype


def quantize(x: mx.array, group_size: int, bits: int) -> tuple:
    """``(packed, scales, biases)`` of ``x``, the scales and biases in ``scale_dtype``."""
    if scale_dtype(x.dtype) != x.dtype:  # no cast node on the decode path when none is due
        x = x.astype(scale_dtype(x.dtype))
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def dequantize(x: Storage, group_size: int, bits: int, dtype=None) -> mx.array:
    """A float array of what is stored, computed in ``dtype`` (default: the scales'; float32
    gives what mlx's quantized matmul computes); a plain array is returned as is."""
    if not isinstance(x, tuple):
        return x
    packed, scales, biases = x
    if dtype is not None and dtype != scales.dtype:
        scales, biases = scales.astype(dtype), biases.astype(dtype)
    return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)


def apply(fn: Callable, *xs: Storage) -> Storage:
    """``fn`` on plain arrays, or part by part on triplets (all arguments of one kind)."""
    if isinstance(xs[0], tuple):
        return tuple(fn(*parts) for parts in zip(*xs, strict=True))
    return fn(*xs)


def assign(x: Storage, start: int, end: int, new: Storage) -> None:
    """``x[:, :, start:end] = new`` in place (each part of a triplet)."""
    if not isinstance(x, tuple):
        x[:, :, start:end] = new
        return
    for part, value in zip(x, new, strict=True):
        part[:, :, start:end] = value


def parts(x: Storage) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def dims(x: Storage) -> tuple[int, int, int]:
    """(batch, KV heads, slots) of the storage."""
    return (x[0] if isinstance(x, tuple) else x).shape[:3]


def dtype(x: Storage):
    """The stored float dtype: a plain array's, a triplet's scales' (``scale_dtype``)."""
    return x[1].dtype if isinstance(x, tuple) else x.dtype


def head_dim(x: Storage, group_size: int | None) -> int:
    return x[1].shape[3] * group_size if isinstance(x, tuple) else x.shape[3]


def nbytes(x: Storage) -> int:
    return sum(p.nbytes for p in parts(x))


def row_bytes(dim: int, dtype_size: int, bits: int | None, group_size: int) -> int:
    """Bytes of one stored token row of ``dim`` elements (packed bits + scale + bias per
    group when quantized)."""
    if bits is None:
        return dim * dtype_size
    return dim * bits // 8 + 2 * (dim // group_size) * dtype_size


def check_triplet(name: str, x, bits: int, group_size: int) -> None:
    """Raise ``ValueError`` unless ``x`` is a consistent (packed, scales, biases) triplet."""
    ok = isinstance(x, (tuple, list)) and len(x) == 3
    ok = ok and all(isinstance(p, mx.array) and p.ndim == 4 for p in x)
    if not ok:
        raise ValueError(f"saved cache: {name} must be 3 4-d MLX arrays (packed, scales, biases)")
    packed, scales, biases = x
    dim = scales.shape[3] * group_size
    if (
        packed.dtype != mx.uint32
        or not mx.issubdtype(scales.dtype, mx.floating)
        or biases.dtype != scales.dtype
        or scales.shape != biases.shape
        or packed.shape[:3] != scales.shape[:3]
        or packed.shape[3] * 32 != dim * bits
        or 0 in packed.shape
    ):
        raise ValueError(
            f"saved cache: {name} parts {[(tuple(p.shape), str(p.dtype)) for p in x]} are not "
            f"a {bits}-bit, group-size {group_size} quantization"
        )


class QuantizedBits:
    """What mlx_lm reads off a quantized cache (``bits``, ``group_size``), from ``config``: for
    ``MorphKVCache`` and ``BatchMorphKVCache``."""

    @property
    def bits(self) -> int:
        """Bits per stored element; absent (AttributeError) when unquantized, because mlx_lm's
        attention takes its quantized path exactly when the cache has ``bits``."""
        if self.config.kv_bits is None:
            raise AttributeError(
                f"this {type(self).__name__} stores keys and values unquantized")
        return self.config.kv_bits

    @property
    def group_size(self) -> int:
        """Elements per quantization group; absent when unquantized (see ``bits``)."""
        if self.config.kv_bits is None:
            raise AttributeError(
                f"this {type(self).__name__} stores keys and values unquantized")
        return self.config.kv_group_size


class QuantizedAttributes(QuantizedBits):
    """``QuantizedBits`` and the switch to quantized storage (``to_quantized``), for
    ``MorphKVCache``."""

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> QuantizedAttributes:
        """This cache with quantized storage: the same kept tokens and selection state, keys
        and values quantized. mlx_lm's ``generate_step(kv_bits=...)`` calls it on every cache
        after each step once ``offset >= quantized_kv_start``, so a cache already stored this
        way returns itself; another precision raises ``ValueError`` (requantizing would lose
        more than asked)."""
        if (self.config.kv_bits, self.config.kv_group_size) == (bits, group_size):
            return self
        if self.config.kv_bits is not None:
            raise ValueError(
                f"this cache already stores {self.config.kv_bits}-bit keys/values (group size "
                f"{self.config.kv_group_size}); cannot convert to {bits}-bit, group size "
                f"{group_size}"
            )
        config = dataclasses.replace(self.config, kv_bits=bits, kv_group_size=group_size)
        config.validate()
        self._flush()
        if self.keys is not None:
            dims = (self.keys.shape[3], self.values.shape[3])
            if any(d % group_size for d in dims):
                raise ValueError(f"kv_group_size={group_size} must divide the head dims {dims}")
        new = copy.copy(self)
        engine = copy.deepcopy(self.engine, {id(self): new})
        keys = values = None
        if self.keys is not None:
            # pieces are written in place into storage of the engine's capacity: keep it all
            keys, values = (quantize(x, group_size, bits) for x in (self.keys, self.values))
        new.adopt(engine, keys, values, config)
        return new
