"""Check a GGUF header in pure Python before the ``gguf`` library (or MLX) is handed the file.

The ``gguf`` library's ``GGUFReader`` (llama.cpp's own Python reader, 0.19) trusts the header:
it builds one NumPy view per array item with no bound on the count (a crafted count of 2**40
loops for ever), slices of its memory map past the end of the file come back short instead of
failing, and dims, offsets and sizes are not checked against the file. This walk of a
memory-mapped file with every count, length, dimension and offset bounded by the file size
(and by hard limits far above any real model), and keeps only what the checks need: metadata
scalars and strings, and for arrays their element type and length (never their items). Every
problem is one ``GGUFError`` naming the field and its value.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64
metadata count, metadata (key string, u32 type, value), tensor infos (name, u32 n_dims, u64
dims[n_dims], u32 type, u64 offset), padding to ``general.alignment``, tensor data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_VERSIONS = (2, 3)
MAX_TENSORS = 1 << 16
MAX_METADATA = 1 << 16
MAX_KEY_BYTES = 1 << 16
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 16

# metadata value types: (name, struct format or None)
VALUE_TYPES = {
    0: ("uint8", "<B"),
    1: ("int8", "<b"),
    2: ("uint16", "<H"),
    3: ("int16", "<h"),
    4: ("uint32", "<I"),
    5: ("int32", "<i"),
    6: ("float32", "<f"),
    7: ("bool", "<?"),
    8: ("string", None),
    9: ("array", None),
    10: ("uint64", "<Q"),
    11: ("int64", "<q"),
    12: ("float64", "<d"),
}
INT_TYPES = frozenset(("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"))
FLOAT_TYPES = frozenset(("float32", "float64"))


def _tensor_types() -> dict[int, tuple[str, int, int]]:
    """ggml tensor types the ``gguf`` library turns into floats: id -> (name, block elements,
    block bytes), from the library's own tables (F32, F16, BF16 and every type with a
    dequantizer in ``gguf.quants``: Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ*, TQ*, MXFP4 ...)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import _type_traits

    T = GGMLQuantizationType
    kinds = {T.F32, T.F16, *_type_traits}
    return {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in sorted(kinds)}


TENSOR_TYPES = _tensor_types()


class GGUFError(ValueError):
    """The GGUF file is malformed or not a model of a family this loader understands."""


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array: its element type and length (the items are not kept)."""

    elem_type: str
    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the innermost (row length)
    type_id: int
    offset: int  # relative to the start of the data section
    nbytes: int

    @property
    def type_name(self) -> str:
        return TENSOR_TYPES[self.type_id][0]

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major shape (outermost first), as for the unquantized array."""
        return tuple(reversed(self.dims))


@dataclass
class GGUFHeader:
    path: str
    version: int
    file_size: int
    metadata: dict[str, Any] = field(default_factory=dict)  # scalars, str, GGUFArray
    value_types: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    data_start: int = 0


class _Reader:
    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(
                f"GGUF {what} needs {n} bytes at offset {self.pos}, "
                f"but the file has {self.size} bytes (truncated or corrupt)"
            )

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.unpack("<Q", f"{what} length")
        if limit is not None and n > limit:
            raise GGUFError(f"GGUF {what} length {n} exceeds the limit {limit}")
        if n > self.remaining():
            raise GGUFError(
                f"GGUF {what} length {n} exceeds the {self.remaining()} bytes left in the file"
            )
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"GGUF {what} is not valid UTF-8 ({e.reason})") from None
        return s

    def remaining(self) -> int:
        return self.size - self.pos


def _count(r: _Reader, what: str, limit: int, min_item_bytes: int) -> int:
    n = r.unpack("<Q", what)
    bound = min(limit, r.remaining() // min_item_bytes)
    if n > bound:
        raise GGUFError(
            f"GGUF {what} {n} is impossible: at most {bound} fit in the file "
            f"({r.size} bytes, limit {limit})"
        )
    return n


def _value(r: _Reader, type_id: int, key: str) -> Any:
    if type_id not in VALUE_TYPES:
        raise GGUFError(f"GGUF metadata {key!r} has unknown value type {type_id}")
    name, fmt = VALUE_TYPES[type_id]
    if fmt is not None:
        return r.unpack(fmt, f"metadata {key!r} value")
    if name == "string":
        return r.string(f"metadata {key!r} string")
    elem = r.unpack("<I", f"metadata {key!r} array type")
    if elem not in VALUE_TYPES:
        raise GGUFError(f"GGUF metadata {key!r} has unknown array element type {elem}")
    elem_name, elem_fmt = VALUE_TYPES[elem]
    if elem_name == "array":
        raise GGUFError(f"GGUF metadata {key!r} is a nested array (not supported)")
    item = struct.calcsize(elem_fmt) if elem_fmt else 8
    n = _count(r, f"metadata {key!r} array length", 1 << 40, item)
    if elem_fmt is not None:
        r.need(n * item, f"metadata {key!r} array")
        r.pos += n * item
    else:
        _skip_strings(r, n, key)
    return GGUFArray(elem_name, n)


def _skip_strings(r: _Reader, n: int, key: str) -> None:
    """Walk ``n`` length-prefixed strings (bounds and UTF-8 checked, nothing kept)."""
    buf, size, pos, unpack = r.buf, r.size, r.pos, struct.unpack_from
    for i in range(n):
        if pos + 8 > size:
            r.pos = pos
            r.need(8, f"metadata {key!r} string {i} length")
        (ln,) = unpack("<Q", buf, pos)
        pos += 8
        if ln > size - pos:
            raise GGUFError(
                f"GGUF metadata {key!r} string {i} length {ln} exceeds the {size - pos} "
                "bytes left in the file"
            )
        try:
            buf[pos : pos + ln].decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(
                f"GGUF metadata {key!r} string {i} is not valid UTF-8 ({e.reason})"
            ) from None
        pos += ln
    r.pos = pos


def _type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return "unknown"


def _tensor_info(r: _Reader, index: int) -> tuple[str, tuple[int, ...], int, int]:
    name = r.string(f"tensor {index} name", limit=MAX_KEY_BYTES)
    n_dims = r.unpack("<I", f"tensor {name!r} n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"GGUF tensor {name!r} has n_dims={n_dims} (expected 1..{MAX_DIMS})")
    dims = tuple(r.unpack("<Q", f"tensor {name!r} dims") for _ in range(n_dims))
    if any(d < 1 for d in dims):
        raise GGUFError(f"GGUF tensor {name!r} has a zero dimension: dims={list(dims)}")
    type_id = r.unpack("<I", f"tensor {name!r} type")
    if type_id not in TENSOR_TYPES:
        known = ", ".join(v[0] for v in TENSOR_TYPES.values())
        tname = _type_name(type_id)
        raise GGUFError(
            f"GGUF tensor {name!r} has type {tname} ({type_id}); this loader supports {known}"
        )
    offset = r.unpack("<Q", f"tensor {name!r} offset")
    return name, dims, type_id, offset


def _nbytes(name: str, dims: tuple[int, ...], type_id: int, limit: int) -> int:
    tname, block, block_bytes = TENSOR_TYPES[type_id]
    if dims[0] % block:
        raise GGUFError(
            f"GGUF tensor {name!r} of type {tname}: row length dims[0]={dims[0]} "
            f"is not a multiple of the block size {block}"
        )
    n = 1
    for d in dims:
        n *= d
        if n > limit:  # Python ints do not overflow; stop early anyway
            break
    nbytes = n // block * block_bytes
    if nbytes > limit:
        raise GGUFError(
            f"GGUF tensor {name!r} dims={list(dims)} ({tname}) needs {nbytes} bytes, "
            f"more than the file's {limit}"
        )
    return nbytes


def _parse(buf, size: int, path: str) -> GGUFHeader:
    r = _Reader(buf, size)
    r.need(4, "magic")
    magic = bytes(buf[0:4])
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    r.pos = 4
    version = r.unpack("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"GGUF version {version} is not supported (supported: 2, 3)")
    n_tensors = _count(r, "tensor count", MAX_TENSORS, 8 + 4 + 8 + 4 + 8)
    n_kv = _count(r, "metadata count", MAX_METADATA, 8 + 4 + 1)
    h = GGUFHeader(path=path, version=version, file_size=size)
    for i in range(n_kv):
        key = r.string(f"metadata key {i}", limit=MAX_KEY_BYTES)
        if key in h.metadata:
            raise GGUFError(f"GGUF metadata key {key!r} appears twice")
        type_id = r.unpack("<I", f"metadata {key!r} type")
        h.metadata[key] = _value(r, type_id, key)
        h.value_types[key] = VALUE_TYPES[type_id][0]
    raw, seen = [], set()
    for i in range(n_tensors):
        name, dims, type_id, offset = _tensor_info(r, i)
        if name in seen:
            raise GGUFError(f"GGUF tensor {name!r} appears twice")
        seen.add(name)
        raw.append((name, dims, type_id, offset))
    align = h.metadata.get("general.alignment", 32)
    if h.value_types.get("general.alignment", "uint32") != "uint32" or not (
        isinstance(align, int) and 0 < align <= MAX_ALIGNMENT and align & (align - 1) == 0
    ):
        raise GGUFError(f"GGUF general.alignment={align!r} is not a uint32 power of two <= 65536")
    h.data_start = -(-r.pos // align) * align
    room = size - h.data_start
    for name, dims, type_id, offset in raw:
        nbytes = _nbytes(name, dims, type_id, max(room, 0))
        if offset % align or offset + nbytes > room:
            raise GGUFError(
                f"GGUF tensor {name!r} offset={offset} (+{nbytes} bytes) lies outside the "
                f"data section ({max(room, 0)} bytes) or is not aligned to {align}"
            )
        h.tensors[name] = TensorInfo(name, dims, type_id, offset, nbytes)
    return h


def parse_header(data: bytes, name: str = "<bytes>") -> GGUFHeader:
    """``read_header`` for a GGUF file already in memory."""
    if len(data) < 24:
        raise GGUFError(f"{name} is too small to be a GGUF file ({len(data)} bytes)")
    return _parse(data, len(data), name)


def read_header(path: str | Path) -> GGUFHeader:
    """Parse and bounds-check the header of the GGUF file at ``path`` (no tensor data read)."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise GGUFError(f"{path} is too small to be a GGUF file ({size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _parse(mm, size, path)
    except OSError as e:
        raise GGUFError(f"cannot read GGUF {path}: {e}") from e
