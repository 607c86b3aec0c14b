"""Load a GGUF file (llama, qwen2, qwen3 or gemma3 family) into mlx_lm's own model class.

1. ``check_gguf``: the header is walked in pure Python with every count, length, dimension,
   type and offset bounded by the file (``gguf_header``) and checked to describe a model of a
   supported family (``gguf_check``). The ``gguf`` library does not bound these itself, so
   nothing reaches it before this check; every failure is a ``GGUFError`` (a ValueError).
2. ``gguf.GGUFReader`` (llama.cpp's own Python reader) memory-maps the checked file; metadata
   and tensors come from it, and each tensor is dequantized by the library and turned into MLX
   weights (``gguf_tensors``: dense float32, or MLX 4/8-bit affine on a GPU).
3. The family's mlx_lm model (``gguf_arch``) is built and loaded with ``strict=True``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from .gguf_arch import build_model, model_args, norm_shift
from .gguf_check import ModelSpec, check_model
from .gguf_header import GGUFError, GGUFHeader, read_header
from .gguf_names import map_tensor_name
from .gguf_tensors import GROUP_SIZE, convert, dequantize

__all__ = [
    "GGUFError", "check_gguf", "load_gguf", "map_tensor_name", "model_args", "read_gguf",
    "read_metadata",
]  # fmt: skip


def check_gguf(path: str | Path) -> tuple[GGUFHeader, ModelSpec]:
    """Parse and validate the header of ``path`` (nothing allocated beyond the header)."""
    try:
        header = read_header(path)
        return header, check_model(header)
    except GGUFError as e:
        if str(path) in str(e):
            raise
        raise GGUFError(f"{path}: {e}") from None


def open_reader(header: GGUFHeader):
    """``gguf.GGUFReader`` of a checked file; its tensors must be the header's."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(header.path)
    except Exception as e:  # the library raises ValueError / KeyError / numpy errors
        first = (str(e).splitlines() or [type(e).__name__])[0][:300]
        raise GGUFError(f"cannot read GGUF {header.path}: {first}") from e
    got = {t.name: (tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in reader.tensors}
    want = {n: (t.dims, t.type_id) for n, t in header.tensors.items()}
    if got != want:
        odd = sorted(set(got.items()) ^ set(want.items()))[:2]
        raise GGUFError(f"the gguf library read tensors that differ from the checked header: {odd}")
    return reader


def read_metadata(reader) -> dict[str, Any]:
    """Metadata key -> value (str, int, float, bool or a list of them) from a ``GGUFReader``."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Check the header, then read every tensor dequantized to float32 by the library:
    (tensors by GGUF name, metadata)."""
    header, _ = check_gguf(path)
    reader = open_reader(header)
    return {t.name: mx.array(dequantize(t)) for t in reader.tensors}, read_metadata(reader)


def dequantize_model(model: nn.Module, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """Replace every QuantizedLinear / QuantizedEmbedding by a dense layer of ``dtype``."""

    def _dense(m):
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
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


def mlx_weights(reader, arch: str, *, quantized: bool) -> tuple[dict[str, mx.array], dict]:
    """mlx_lm parameter name -> array for every tensor, and module path -> bits."""
    shift = norm_shift(arch)
    weights: dict[str, mx.array] = {}
    qbits: dict[str, int] = {}
    for t in reader.tensors:
        base = map_tensor_name(t.name, arch).rsplit(".", 1)[0]
        is_norm = t.name.endswith("norm.weight")
        c = convert(t, quantized=quantized, shift=shift if is_norm else 0.0)
        kind = "bias" if t.name.endswith(".bias") else None
        for part, arr in c.arrays.items():
            weights[f"{base}.{kind or part}"] = arr
        if c.bits is not None:
            qbits[base] = c.bits
    return weights, qbits


def load_gguf(
    path: str | Path,
    *,
    rope_traditional: bool = True,
    dequantize: bool | None = None,
    lazy: bool = False,
) -> tuple[nn.Module, dict[str, Any]]:
    """Build the family's mlx_lm model from a GGUF file. Returns (model, metadata).

    ``dequantize`` (default: on the CPU device) keeps every weight as dense float32, exactly
    the ``gguf`` library's dequantized values; otherwise quantized tensors become MLX 4/8-bit
    affine layers (``gguf_tensors``). ``rope_traditional``: llama files only (see gguf_arch).
    """
    header, spec = check_gguf(path)  # GGUFError before the library is handed the file
    reader = open_reader(header)
    meta = read_metadata(reader)
    if dequantize is None:
        dequantize = _default_dequantize()
    try:
        weights, qbits = mlx_weights(reader, spec.arch, quantized=not dequantize)
    except (ValueError, NotImplementedError) as e:
        raise GGUFError(f"GGUF {header.path}: {str(e).splitlines()[0][:300]}") from e
    model = build_model(header, spec, rope_traditional=rope_traditional)
    if qbits:
        nn.quantize(
            model,
            class_predicate=lambda p, _m: (
                {"group_size": GROUP_SIZE, "bits": qbits[p], "mode": "affine"} if p in qbits
                else False
            ),
        )  # fmt: skip
    weights = model.sanitize(weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:  # should not happen after check_gguf; keep the message short
        raise GGUFError(f"GGUF {header.path}: {str(e).splitlines()[0][:300]}") from e
    if not lazy:
        mx.eval(model.parameters())
    model.eval()
    return model, meta
