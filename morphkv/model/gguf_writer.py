"""Write small GGUF files: a tiny random Llama model for tests, and the byte offsets of every
header field so a test can corrupt one field at a time.

Only what the loader reads is supported: scalar, string and flat array metadata, and tensors
of type F32, F16, Q4_0, Q4_1 and Q8_0 (quantized data is random bytes with finite scales).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .gguf_header import _VALUE_TYPES, TENSOR_TYPES

_TYPE_ID = {name: i for i, (name, _fmt) in _VALUE_TYPES.items()}
_TENSOR_ID = {v[0]: i for i, v in TENSOR_TYPES.items()}


@dataclass
class Meta:
    key: str
    vtype: str  # a GGUF value type name: "uint32", "string", "array", ...
    value: Any
    elem: str | None = None  # element type name of an array


@dataclass
class Tensor:
    name: str
    dims: tuple[int, ...]  # GGUF order, innermost first
    ttype: str  # "F32", "F16", "Q4_0", "Q4_1", "Q8_0"


@dataclass
class Layout:
    """Offsets (into the file) of the header fields: name -> (offset, struct format)."""

    fields: dict[str, tuple[int, str]] = field(default_factory=dict)
    header_end: int = 0


def _tensor_bytes(t: Tensor, rng: np.random.Generator) -> bytes:
    _, block, block_bytes = TENSOR_TYPES[_TENSOR_ID[t.ttype]]
    n = int(np.prod(t.dims))
    if t.ttype == "F32":
        return rng.standard_normal(n).astype("<f4").tobytes()
    if t.ttype == "F16":
        return rng.standard_normal(n).astype("<f2").tobytes()
    out = bytearray(rng.integers(0, 256, n // block * block_bytes, dtype=np.uint8).tobytes())
    n_scales = 2 if t.ttype == "Q4_1" else 1  # Q4_1: scale and min; others: scale
    for b in range(n // block):
        for j in range(n_scales):
            struct.pack_into("<e", out, b * block_bytes + 2 * j, 0.01)
    return bytes(out)


def _pack_value(buf: bytearray, vtype: str, value: Any, elem: str | None) -> None:
    if vtype == "string":
        raw = value.encode("utf-8")
        buf += struct.pack("<Q", len(raw)) + raw
    elif vtype == "array":
        buf += struct.pack("<IQ", _TYPE_ID[elem], len(value))
        for v in value:
            _pack_value(buf, elem, v, None)
    else:
        buf += struct.pack(_VALUE_TYPES[_TYPE_ID[vtype]][1], value)


def write_gguf(
    meta: list[Meta], tensors: list[Tensor], *, version: int = 3, seed: int = 0, align: int = 32
) -> tuple[bytes, Layout]:
    """The bytes of a GGUF file, and the layout of its header (``align``: the data alignment,
    also to be stated as ``general.alignment`` in ``meta`` when not 32)."""
    rng = np.random.default_rng(seed)
    lay = Layout()
    buf = bytearray(b"GGUF")

    def put(name: str, fmt: str, value) -> None:
        lay.fields[name] = (len(buf), fmt)
        buf.extend(struct.pack(fmt, value))

    put("version", "<I", version)
    put("tensor_count", "<Q", len(tensors))
    put("metadata_count", "<Q", len(meta))
    for m in meta:
        put(f"meta:{m.key}:keylen", "<Q", len(m.key.encode()))
        buf.extend(m.key.encode())
        put(f"meta:{m.key}:type", "<I", _TYPE_ID[m.vtype])
        if m.vtype == "array":
            put(f"meta:{m.key}:elem", "<I", _TYPE_ID[m.elem])
            put(f"meta:{m.key}:count", "<Q", len(m.value))
            for v in m.value:
                _pack_value(buf, m.elem, v, None)
        elif m.vtype == "string":
            put(f"meta:{m.key}:len", "<Q", len(m.value.encode()))
            buf.extend(m.value.encode())
        else:
            put(f"meta:{m.key}", _VALUE_TYPES[_TYPE_ID[m.vtype]][1], m.value)
    datas, offset = [], 0
    for t in tensors:
        data = _tensor_bytes(t, rng)
        put(f"tensor:{t.name}:namelen", "<Q", len(t.name))
        buf.extend(t.name.encode())
        put(f"tensor:{t.name}:n_dims", "<I", len(t.dims))
        for i, d in enumerate(t.dims):
            put(f"tensor:{t.name}:dim{i}", "<Q", d)
        put(f"tensor:{t.name}:type", "<I", _TENSOR_ID[t.ttype])
        put(f"tensor:{t.name}:offset", "<Q", offset)
        datas.append(data)
        offset += -(-len(data) // align) * align
    lay.header_end = len(buf)
    buf.extend(b"\0" * (-len(buf) % align))
    for data in datas:
        buf.extend(data + b"\0" * (-len(data) % align))
    return bytes(buf), lay


def tiny_llama_meta(
    *, hidden: int = 32, layers: int = 2, heads: int = 2, kv_heads: int = 1, ffn: int = 32
) -> list[Meta]:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<unk>", "<s>", "</s>", "Ġ", *letters, "ab", "Ġa"]
    p = "llama."
    return [
        Meta("general.architecture", "string", "llama"),
        Meta(p + "block_count", "uint32", layers),
        Meta(p + "context_length", "uint32", 256),
        Meta(p + "embedding_length", "uint32", hidden),
        Meta(p + "feed_forward_length", "uint32", ffn),
        Meta(p + "attention.head_count", "uint32", heads),
        Meta(p + "attention.head_count_kv", "uint32", kv_heads),
        Meta(p + "rope.freq_base", "float32", 10000.0),
        Meta(p + "attention.layer_norm_rms_epsilon", "float32", 1e-5),
        Meta("tokenizer.ggml.model", "string", "gpt2"),
        Meta("tokenizer.ggml.pre", "string", "smollm"),
        Meta("tokenizer.ggml.tokens", "array", tokens, "string"),
        Meta("tokenizer.ggml.token_type", "array", [3, 3, 3] + [1] * (len(tokens) - 3), "int32"),
        Meta("tokenizer.ggml.merges", "array", ["a b", "Ġ a"], "string"),
        Meta("tokenizer.ggml.bos_token_id", "uint32", 1),
        Meta("tokenizer.ggml.eos_token_id", "uint32", 2),
    ]


def tiny_llama_tensors(
    *, hidden: int = 32, layers: int = 2, heads: int = 2, kv_heads: int = 1, ffn: int = 32,
    vocab: int = 32, tied: bool = False,
) -> list[Tensor]:  # fmt: skip
    hd = hidden // heads
    ts = [Tensor("token_embd.weight", (hidden, vocab), "Q8_0")]
    for i in range(layers):
        b = f"blk.{i}."
        ts += [
            Tensor(b + "attn_norm.weight", (hidden,), "F32"),
            Tensor(b + "attn_q.weight", (hidden, heads * hd), "Q4_1"),
            Tensor(b + "attn_k.weight", (hidden, kv_heads * hd), "Q4_0"),
            Tensor(b + "attn_v.weight", (hidden, kv_heads * hd), "Q8_0"),
            Tensor(b + "attn_output.weight", (heads * hd, hidden), "F16"),
            Tensor(b + "ffn_norm.weight", (hidden,), "F16"),
            Tensor(b + "ffn_gate.weight", (hidden, ffn), "Q4_1"),
            Tensor(b + "ffn_up.weight", (hidden, ffn), "F32"),
            Tensor(b + "ffn_down.weight", (ffn, hidden), "Q4_0"),
        ]
    ts.append(Tensor("output_norm.weight", (hidden,), "F32"))
    if not tied:
        ts.append(Tensor("output.weight", (hidden, vocab), "F16"))
    return ts


def tiny_llama_gguf(*, seed: int = 0, **kw) -> tuple[bytes, Layout]:
    """A valid 2-block Llama GGUF of a few KB (random weights, 32-token vocabulary)."""
    meta_kw = {k: v for k, v in kw.items() if k in ("hidden", "layers", "heads", "kv_heads", "ffn")}
    return write_gguf(tiny_llama_meta(**meta_kw), tiny_llama_tensors(**kw), seed=seed)
