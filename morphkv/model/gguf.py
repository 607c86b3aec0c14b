"""Load a Llama-family GGUF file into mlx_lm's own ``mlx_lm.models.llama.Model``.

``mx.load(path, return_metadata=True)`` reads GGUF natively: Q4_0 / Q4_1 / Q8_0 tensors come
back as MLX affine-quantized triplets (``weight`` uint32, ``scales``, ``biases``; group size 32,
bits per tensor), F16/F32 tensors as plain arrays. This module maps the llama.cpp tensor names
to mlx_lm's names, quantizes exactly the layers that are stored quantized (with the bits read
from each tensor), and builds the hyperparameters from the GGUF metadata.

Nothing reaches ``mx.load`` before ``check_gguf`` has read the header in pure Python and
checked it (``gguf_header``: counts, lengths, dims, offsets, types; ``gguf_check``: the
metadata and every tensor's shape describe a Llama model): ``mx.load`` trusts the header, and
a crafted one crashes it or exhausts memory. Every failure is a ``GGUFError`` (a ValueError).

llama.cpp stores the Q and K projections permuted for its interleaved ("traditional") RoPE
layout, so the model must be built with ``rope_traditional=True``; the argument exists so a
test can load it the wrong way on purpose.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models import llama

from .gguf_check import LlamaSpec, check_llama, map_tensor_name
from .gguf_header import GGUFError, GGUFHeader, read_header

__all__ = ["GGUFError", "check_gguf", "load_gguf", "map_tensor_name", "read_gguf"]

GGUF_GROUP_SIZE = 32


def check_gguf(path: str | Path) -> tuple[GGUFHeader, LlamaSpec]:
    """Parse and validate the header of ``path`` (nothing allocated beyond the header)."""
    try:
        header = read_header(path)
        return header, check_llama(header)
    except GGUFError as e:
        if str(path) in str(e):
            raise
        raise GGUFError(f"{path}: {e}") from None


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Validate the header, then ``mx.load`` the file; returns (tensors by GGUF name, metadata)."""
    header, _ = check_gguf(path)
    return _mx_load(header)


def _mx_load(header: GGUFHeader) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """``mx.load`` a checked file; the tensors it returns must be the header's."""
    try:
        weights, meta = mx.load(header.path, return_metadata=True)
    except Exception as e:  # mx.load raises plain ValueError/RuntimeError
        first = (str(e).splitlines() or [type(e).__name__])[0][:300]
        raise GGUFError(f"cannot read GGUF {header.path}: {first}") from e
    want = set()
    for name, t in header.tensors.items():
        if t.type_name.startswith("Q"):
            base = name[: -len(".weight")]
            want |= {name, base + ".scales", base + ".biases"}
        else:
            want.add(name)
    if set(weights) != want:
        odd = sorted(set(weights) ^ want)[:3]
        raise GGUFError(f"mx.load read tensors that differ from the GGUF header: {odd}")
    return weights, meta


def _f32_round(x: float) -> float:
    """1e-05 stored as float32 reads back as 9.99999974e-06; give the decimal value."""
    return float(f"{float(x):.7g}")


def model_args(
    header: GGUFHeader, spec: LlamaSpec, *, rope_traditional: bool = True
) -> llama.ModelArgs:
    """mlx_lm ``ModelArgs`` of a checked header."""
    meta, p = header.metadata, "llama."
    rope_scaling = None
    if meta.get(p + "rope.scaling.type") == "linear":
        rope_scaling = {"type": "linear", "factor": float(meta[p + "rope.scaling.factor"])}
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        intermediate_size=spec.ffn,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        rms_norm_eps=_f32_round(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=spec.vocab,
        max_position_embeddings=int(meta.get(p + "context_length", 4096)),
        rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
        rope_traditional=rope_traditional,
        rope_scaling=rope_scaling,
        tie_word_embeddings=spec.tied,
    )


def _bits_of(weight: mx.array, scales: mx.array, group_size: int = GGUF_GROUP_SIZE) -> int:
    # packed uint32 columns * 32 bits == input_dims * bits; input_dims == scales cols * group
    return (weight.shape[-1] * 32) // (scales.shape[-1] * group_size)


def dequantize_model(model: nn.Module, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """Replace every QuantizedLinear / QuantizedEmbedding by a dense layer of ``dtype``."""

    def _dense(m):
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            # scales/biases in the target dtype first: dequantizing in float16 would round
            w = mx.dequantize(
                m.weight, m.scales.astype(dtype), m.biases.astype(dtype), m.group_size, m.bits
            )
            if isinstance(m, nn.QuantizedEmbedding):
                out = nn.Embedding(w.shape[0], w.shape[1])
            else:
                out = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
                if "bias" in m:
                    out.bias = m.bias.astype(dtype)
            out.weight = w
            return out
        return m

    model.update_modules(tree_map(_dense, model.leaf_modules(), is_leaf=nn.Module.is_module))
    return model


def _default_dequantize() -> bool:
    # MLX's CPU quantized matmul is ~20x slower than a dense BLAS matmul for prompt chunks
    # (256 tokens: ~50 s vs ~2.7 s for SmolLM2-135M on 2 cores); GPUs do fine quantized.
    return mx.default_device() == mx.cpu


def load_gguf(
    path: str | Path,
    *,
    rope_traditional: bool = True,
    float_dtype: mx.Dtype | None = None,
    dequantize: bool | None = None,
    lazy: bool = False,
) -> tuple[llama.Model, dict[str, Any]]:
    """Build ``mlx_lm.models.llama.Model`` from a GGUF file. Returns (model, metadata).

    The quantized tensors are loaded into QuantizedLinear / QuantizedEmbedding layers with
    the bits stored in the file. ``dequantize`` then expands them to dense float32 layers
    (default: on the CPU device, where that is much faster; the weights' values are the
    same). ``float_dtype`` (e.g. ``mx.float32``) casts the non-integer tensors (norms,
    scales, biases, unquantized weights); None keeps the file's dtypes.
    """
    header, spec = check_gguf(path)  # GGUFError before anything is allocated
    raw, meta = _mx_load(header)
    args = model_args(header, spec, rope_traditional=rope_traditional)
    weights: dict[str, mx.array] = {}
    for name, arr in raw.items():
        if float_dtype is not None and mx.issubdtype(arr.dtype, mx.floating):
            arr = arr.astype(float_dtype)
        weights[map_tensor_name(name)] = arr

    # bits per quantized module, read from the stored tensors
    qbits: dict[str, int] = {}
    for key, arr in weights.items():
        if key.endswith(".scales"):
            base = key[: -len(".scales")]
            qbits[base] = _bits_of(weights[base + ".weight"], arr)

    model = llama.Model(args)

    def predicate(module_path: str, module: nn.Module):
        bits = qbits.get(module_path)
        if bits is None:
            return False
        return {"group_size": GGUF_GROUP_SIZE, "bits": bits, "mode": "affine"}

    if qbits:
        nn.quantize(model, class_predicate=predicate)

    weights = model.sanitize(weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:  # should not happen after check_gguf; keep the message short
        raise GGUFError(f"GGUF {header.path}: {str(e).splitlines()[0][:300]}") from e
    if dequantize is None:
        dequantize = _default_dequantize()
    if dequantize and qbits:
        dequantize_model(model, float_dtype or mx.float32)
    if not lazy:
        mx.eval(model.parameters())
    model.eval()
    return model, meta
