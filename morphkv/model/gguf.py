"""Load a Llama-family GGUF file into mlx_lm's own ``mlx_lm.models.llama.Model``.

``mx.load(path, return_metadata=True)`` reads GGUF natively: Q4_0 / Q4_1 / Q8_0 tensors come
back as MLX affine-quantized triplets (``weight`` uint32, ``scales``, ``biases``; group size 32,
bits per tensor), F16/F32 tensors as plain arrays. This module maps the llama.cpp tensor names
to mlx_lm's names, quantizes exactly the layers that are stored quantized (with the bits read
from each tensor), and builds the hyperparameters from the GGUF metadata.

llama.cpp stores the Q and K projections permuted for its interleaved ("traditional") RoPE
layout, so the model must be built with ``rope_traditional=True``; the argument exists so a
test can load it the wrong way on purpose.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models import llama

GGUF_GROUP_SIZE = 32

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_MAP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


class GGUFError(ValueError):
    """The GGUF file is not a Llama-family model this loader understands."""


def _scalar(meta: dict, key: str, default: Any = None) -> Any:
    if key not in meta:
        if default is None:
            raise GGUFError(f"GGUF metadata lacks {key!r}")
        return default
    v = meta[key]
    if isinstance(v, mx.array):
        return v.item()
    return v


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """``mx.load`` a GGUF file; returns (tensors by GGUF name, metadata)."""
    path = str(path)
    try:
        weights, meta = mx.load(path, return_metadata=True)
    except Exception as e:  # mx.load raises plain ValueError/RuntimeError
        raise GGUFError(f"cannot read GGUF {path}: {e}") from e
    return weights, meta


def _f32_round(x: float) -> float:
    """1e-05 stored as float32 reads back as 9.99999974e-06; give the decimal value."""
    return float(f"{float(x):.7g}")


def map_tensor_name(name: str) -> str:
    """GGUF tensor name -> mlx_lm llama parameter name."""
    m = _BLK_RE.match(name)
    if m:
        idx, part, kind = m.groups()
        if part not in _LAYER_MAP:
            raise GGUFError(f"unsupported GGUF tensor {name}")
        return f"model.layers.{idx}.{_LAYER_MAP[part]}.{kind}"
    m = _TOP_RE.match(name)
    if m and m.group(1) in _TOP_MAP:
        return f"{_TOP_MAP[m.group(1)]}.{m.group(2)}"
    raise GGUFError(f"unsupported GGUF tensor {name}")


def model_args_from_metadata(
    meta: dict[str, Any], weights: dict[str, mx.array], *, rope_traditional: bool = True
) -> llama.ModelArgs:
    arch = _scalar(meta, "general.architecture", "llama")
    if arch != "llama":
        raise GGUFError(f"only Llama-family GGUF files are supported (got {arch!r})")
    p = "llama."
    n_heads = int(_scalar(meta, p + "attention.head_count"))
    hidden = int(_scalar(meta, p + "embedding_length"))
    n_kv = int(_scalar(meta, p + "attention.head_count_kv", n_heads))
    head_dim = int(_scalar(meta, p + "attention.key_length", hidden // n_heads))
    vocab = meta.get(p + "vocab_size")
    if vocab is not None:
        vocab = int(vocab.item() if isinstance(vocab, mx.array) else vocab)
    elif "tokenizer.ggml.tokens" in meta:
        vocab = len(meta["tokenizer.ggml.tokens"])
    else:
        vocab = int(weights["token_embd.weight"].shape[0])
    rope_scaling = None
    scale_type = meta.get(p + "rope.scaling.type")
    if scale_type == "linear":
        rope_scaling = {"type": "linear", "factor": float(_scalar(meta, p + "rope.scaling.factor"))}
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(_scalar(meta, p + "block_count")),
        intermediate_size=int(_scalar(meta, p + "feed_forward_length")),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=_f32_round(_scalar(meta, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=vocab,
        max_position_embeddings=int(_scalar(meta, p + "context_length", 4096)),
        rope_theta=float(_scalar(meta, p + "rope.freq_base", 10000.0)),
        rope_traditional=rope_traditional,
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in weights,
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
    raw, meta = read_gguf(path)
    args = model_args_from_metadata(meta, raw, rope_traditional=rope_traditional)
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
    model.load_weights(list(weights.items()), strict=True)
    if dequantize is None:
        dequantize = _default_dequantize()
    if dequantize and qbits:
        dequantize_model(model, float_dtype or mx.float32)
    if not lazy:
        mx.eval(model.parameters())
    model.eval()
    return model, meta
