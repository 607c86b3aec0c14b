"""GGUF tensors -> MLX weights, through the ``gguf`` library (llama.cpp's own Python package).

The library memory-maps the file and dequantizes every ggml type to float32 in NumPy
(``gguf.quants.dequantize``: F16, BF16, Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ*, TQ*, MXFP4, ...). What
each tensor becomes in MLX:

- **dense** (the default on the CPU device): every tensor as float32, exactly the library's
  dequantized values. MLX's CPU quantized matmul is ~20x slower than a dense BLAS matmul for
  prompt chunks, so dense float32 is the fast choice there (memory: 4 bytes per weight).
- **quantized** (the default on a GPU): 1-D tensors (norms, biases) float32; 2-D tensors stored
  as F32 / F16 / BF16 keep that float type; 2-D tensors stored quantized become MLX affine
  ``mx.quantize`` triplets, 8 bits, group size 32, whatever their GGUF type. Why not 4 bits for
  4-bit files: the file's values sit on its own grid, and re-rounding them onto MLX's 4-bit grid
  (``mx.quantize`` errs by up to one step) added an RMS error of 2.4-9% of the weights' RMS on
  generated tensors of every type (Q4_K 2.4%, Q4_0 6.0%, Q4_1 7.4%), as large as the file's own
  quantization error; 8 bits added 0.15-0.5%. The error against the library's values is tested
  (``tests/test_gguf_types.py``: at most one MLX step per weight, RMS under 1%).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

GROUP_SIZE = 32
FLOAT_TYPES = ("F32", "F16", "BF16")
MLX_BITS = 8
_MX_FLOAT = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}


@dataclass(frozen=True)
class Converted:
    """One tensor's MLX arrays: {"weight": ...} or {"weight", "scales", "biases"} and bits."""

    arrays: dict[str, mx.array]
    bits: int | None = None


def mlx_bits(type_name: str) -> int:
    """Bits of the MLX affine quantization chosen for a quantized ggml type (8 for all: see
    the module docstring)."""
    return MLX_BITS


def dequantize(tensor) -> np.ndarray:
    """float32 values of a ``gguf.ReaderTensor`` (row-major, outermost dim first)."""
    from gguf.quants import dequantize as gguf_dequantize

    out = gguf_dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(out, dtype=np.float32)


def convert(tensor, *, quantized: bool, shift: float = 0.0) -> Converted:
    """MLX arrays of one GGUF tensor (``shift`` is subtracted from the values: Gemma's norms)."""
    type_name = tensor.tensor_type.name
    values = dequantize(tensor)
    if shift:
        values = values - np.float32(shift)
    if not quantized or values.ndim == 1:
        return Converted({"weight": mx.array(values)})
    if type_name in FLOAT_TYPES:
        return Converted({"weight": mx.array(values).astype(_MX_FLOAT[type_name])})
    if values.shape[-1] % GROUP_SIZE:
        return Converted({"weight": mx.array(values)})
    bits = mlx_bits(type_name)
    w, scales, biases = mx.quantize(mx.array(values), group_size=GROUP_SIZE, bits=bits)
    return Converted({"weight": w, "scales": scales, "biases": biases}, bits)
