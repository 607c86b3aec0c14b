"""Write small GGUF files for tests with the ``gguf`` library's ``GGUFWriter``, and give the byte
offset of every header field (read back with ``GGUFReader``) so a test can corrupt one field at a
time. Tiny random-weight models of the llama, qwen2, qwen3 and gemma3 families are in
``gguf_tiny``.

Tensor data: F32 / F16 random normal; BF16 and the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
quantized from random normal values by the library; the K-quants (Q2_K .. Q6_K), which the
library does not quantize, as random blocks whose float16 scale fields are set to small sane
values (every 4-, 5- or 6-bit field of a random block is a valid code).
"""

from __future__ import annotations

import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .gguf_header import VALUE_TYPES

_TYPE_ID = {name: i for i, (name, _fmt) in VALUE_TYPES.items()}
# byte offsets of the float16 scale fields (d, dmin) inside one K-quant block
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
K_SCALE = 0.002


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
    ttype: str  # a ggml type name: "F32", "Q4_K", ...


@dataclass
class Layout:
    """Offsets (into the file) of the header fields: name -> (offset, struct format)."""

    fields: dict[str, tuple[int, str]] = field(default_factory=dict)
    header_end: int = 0


def tensor_data(ttype: str, dims: tuple[int, ...], rng: np.random.Generator):
    """(array for ``GGUFWriter.add_tensor``, raw ggml type or None) of random values."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    shape = tuple(reversed(dims))
    values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    if ttype == "F32":
        return values, None
    if ttype == "F16":
        return values.astype(np.float16), None
    qtype = GGMLQuantizationType[ttype]
    if ttype not in _K_SCALES:
        return quantize(values, qtype), qtype
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(dims)) // block
    raw = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    for off in _K_SCALES[ttype]:
        raw[:, off : off + 2] = np.frombuffer(np.float16(K_SCALE).tobytes(), np.uint8)
    return raw.reshape(*shape[:-1], -1), qtype


def _layout(path: Path) -> Layout:
    """Offsets of the header fields of a GGUF file, from the library's reader."""
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(path)
    lay = Layout()
    lay.fields.update(version=(4, "<I"), tensor_count=(8, "<Q"), metadata_count=(16, "<Q"))
    end = 24
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        offs = [f.offset]
        for part in f.parts:
            offs.append(offs[-1] + int(part.nbytes))
        end = offs[-1]
        lay.fields[f"meta:{key}:keylen"] = (offs[0], "<Q")
        lay.fields[f"meta:{key}:type"] = (offs[2], "<I")
        kind = f.types[0]
        if kind == GGUFValueType.ARRAY:
            lay.fields[f"meta:{key}:elem"] = (offs[3], "<I")
            lay.fields[f"meta:{key}:count"] = (offs[4], "<Q")
        elif kind == GGUFValueType.STRING:
            lay.fields[f"meta:{key}:len"] = (offs[3], "<Q")
        else:
            lay.fields[f"meta:{key}"] = (offs[3], VALUE_TYPES[int(kind)][1])
    for t in r.tensors:
        f, pos = t.field, t.field.offset
        lay.fields[f"tensor:{t.name}:namelen"] = (pos, "<Q")
        pos += int(f.parts[0].nbytes + f.parts[1].nbytes)
        lay.fields[f"tensor:{t.name}:n_dims"] = (pos, "<I")
        pos += 4
        for i in range(len(t.shape)):
            lay.fields[f"tensor:{t.name}:dim{i}"] = (pos, "<Q")
            pos += 8
        lay.fields[f"tensor:{t.name}:type"] = (pos, "<I")
        lay.fields[f"tensor:{t.name}:offset"] = (pos + 4, "<Q")
        end = pos + 12
    lay.header_end = end
    return lay


def write_gguf(
    meta: list[Meta], tensors: list[Tensor], *, seed: int = 0, align: int = 32
) -> tuple[bytes, Layout]:
    """The bytes of a GGUF file written by ``gguf.GGUFWriter``, and the layout of its header
    (``align``: the data alignment, also to be stated as ``general.alignment`` in ``meta`` when
    not 32). Metadata keys are written in the order given."""
    from gguf import GGUFValueType, GGUFWriter

    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="morphkv-gguf-") as tmp:
        path = Path(tmp) / "model.gguf"
        w = GGUFWriter(path, "llama")
        w.kv_data[0].clear()  # the writer adds general.architecture itself; keep meta's order
        w.data_alignment = align
        for m in meta:
            sub = GGUFValueType(_TYPE_ID[m.elem]) if m.elem else None
            w.add_key_value(m.key, m.value, GGUFValueType(_TYPE_ID[m.vtype]), sub)
        for t in tensors:
            data, raw = tensor_data(t.ttype, t.dims, rng)
            w.add_tensor(t.name, data, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        try:
            lay = _layout(path)
        except ValueError:  # a deliberately invalid file (e.g. alignment 48): no offsets
            lay = Layout()
        return path.read_bytes(), lay


def patch_field(data: bytes, lay: Layout, name: str, value) -> bytes:
    """``data`` with the header field ``name`` set to ``value``."""
    off, fmt = lay.fields[name]
    out = bytearray(data)
    struct.pack_into(fmt, out, off, value)
    return bytes(out)


__all__ = ["Layout", "Meta", "Tensor", "patch_field", "tensor_data", "write_gguf"]
