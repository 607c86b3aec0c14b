"""GGUF tensors -> MLX weights, through the ``gguf`` library (llama.cpp's own Python package).

The library memory-maps the file and dequantizes every ggml type to float32 in NumPy
(``gguf.quants.dequantize``: F16, BF16, Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ*, TQ*, MXFP4, ...). What
each tensor becomes in MLX:

- **dense** (the default on the CPU device): every tensor as float32, exactly the library's
  dequantized values. MLX's CPU quantized matmul is ~20x slower than a dense BLAS matmul for
  prompt chunks, so dense float32 is the fast choice there (memory: 4 bytes per weight).
- **quantized** (the default on a GPU): 1-D tensors (norms, biases) float32; 2-D tensors stored
  as F32 / F16 / BF16 keep that float type; 2-D tensors stored quantized become MLX affine
  ``mx.quantize`` triplets, group size 32, with 4 bits where the file used 4 bits or fewer per
  weight (Q4_0, Q4_1, Q4_K, Q2_K, Q3_K, IQ*, TQ*, MXFP4, NVFP4) and 8 bits otherwise (Q5_0, Q5_1,
  Q5_K, Q6_K, Q8_0). Q4_1 and Q4_K are affine over blocks of 32 already and come back nearly
  exactly; the 8-bit grid is 16-64x finer than the 5/6-bit ones it re-encodes. The error of
  each choice against the library's values is tested (``tests/test_gguf_types.py``) and was
  measured on Gemma 3 270M (docs/families.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

GROUP_SIZE = 32
FLOAT_TYPES = ("F32", "F16", "BF16")
_FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K", "Q2_K", "Q3_K", "MXFP4", "NVFP4")
_MX_FLOAT = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}


@dataclass(frozen=True)
class Converted:
    """One tensor's MLX arrays: {"weight": ...} or {"weight", "scales", "biases"} and bits."""

    arrays: dict[str, mx.array]
    bits: int | None = None


def mlx_bits(type_name: str) -> int:
    """Bits of the MLX affine quantization chosen for a quantized ggml type."""
    if type_name in _FOUR_BIT or type_name.startswith(("IQ", "TQ")):
        return 4
    return 8


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
