"""Check a parsed GGUF header describes a model this loader can build, before building it.

Families: ``llama``, ``qwen2``, ``qwen3`` and ``gemma3``. Required metadata (architecture,
sizes, head counts, vocabulary, EOS id) must be present, of the right type and in range, and the
tensors must be exactly the ones a model of that family and those sizes has, each with the shape
the metadata implies. Nothing here reads tensor data or touches MLX.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .gguf_header import FLOAT_TYPES, INT_TYPES, GGUFArray, GGUFError, GGUFHeader
from .gguf_names import FAMILIES, layer_parts, map_tensor_name

MAX_SIZE = 1 << 31  # any single hyperparameter
_TOKEN_IDS = ("bos", "eos", "unknown", "padding", "eot", "eom", "sep", "cls", "mask")
_FLOAT_1D = ("F32", "F16", "BF16")

__all__ = ["ModelSpec", "check_model", "map_tensor_name"]


@dataclass(frozen=True)
class ModelSpec:
    """The hyperparameters of a checked GGUF header."""

    arch: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    n_tokens: int
    tied: bool


def _int(h: GGUFHeader, key: str, default: int | None = None, lo: int = 1) -> int:
    if key not in h.metadata:
        if default is None:
            raise GGUFError(f"GGUF metadata lacks {key!r}")
        return default
    v, t = h.metadata[key], h.value_types[key]
    if t not in INT_TYPES or not lo <= v <= MAX_SIZE:
        raise GGUFError(f"GGUF metadata {key}={v!r} ({t}) must be an integer in {lo}..{MAX_SIZE}")
    return v


def _float(h: GGUFHeader, key: str, lo: float, hi: float) -> None:
    if key in h.metadata:
        v, t = h.metadata[key], h.value_types[key]
        if t not in FLOAT_TYPES or not math.isfinite(v) or not lo < v < hi:
            raise GGUFError(f"GGUF metadata {key}={v!r} ({t}) must be a number in ({lo}, {hi})")


def _str(h: GGUFHeader, key: str, allowed: tuple[str, ...] | None, required: bool) -> None:
    v = h.metadata.get(key)
    if v is None and not required:
        return
    if not isinstance(v, str) or (allowed is not None and v not in allowed):
        want = " or ".join(repr(a) for a in allowed) if allowed else "a string"
        got = "missing" if v is None else repr(v)
        raise GGUFError(f"GGUF metadata {key} is {got}; expected {want}")


def _array(h: GGUFHeader, key: str, elem: frozenset | str, n: int | None, required: bool):
    v = h.metadata.get(key)
    if v is None and not required:
        return None
    ok_elem = isinstance(v, GGUFArray) and (
        v.elem_type in elem if isinstance(elem, frozenset) else v.elem_type == elem
    )
    if not ok_elem or (n is not None and v.count != n) or v.count == 0:
        want = f"a non-empty array of {elem if isinstance(elem, str) else 'integers'}"
        want += f" of length {n}" if n is not None else ""
        raise GGUFError(f"GGUF metadata {key} is {v!r}; expected {want}")
    return v


def _tokenizer(h: GGUFHeader) -> int:
    """``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece: scores and types required)."""
    _str(h, "tokenizer.ggml.model", ("gpt2", "llama"), True)
    spm = h.metadata["tokenizer.ggml.model"] == "llama"
    _str(h, "tokenizer.ggml.pre", None, False)
    _str(h, "tokenizer.chat_template", None, False)
    n = _array(h, "tokenizer.ggml.tokens", "string", None, True).count
    _array(h, "tokenizer.ggml.token_type", INT_TYPES, n, spm)
    _array(h, "tokenizer.ggml.scores", "float32", n, spm)
    _array(h, "tokenizer.ggml.merges", "string", None, False)
    _int(h, "tokenizer.ggml.eos_token_id", lo=0)  # required: else generation never stops
    for name in _TOKEN_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        if key in h.metadata and not 0 <= _int(h, key, lo=0) < n:
            raise GGUFError(f"GGUF metadata {key}={h.metadata[key]} is not a token id (0..{n - 1})")
    return n


def _expected_shapes(s: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Tensor name -> GGUF dims (innermost first) for a model of spec ``s``."""
    H, q, kv, hd = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.head_dim
    dims = {"H": (H,), "q": (q,), "kv": (kv,), "hd": (hd,), "H,q": (H, q), "H,kv": (H, kv),
            "q,H": (q, H), "H,ffn": (H, s.ffn), "ffn,H": (s.ffn, H)}  # fmt: skip
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (H, s.vocab),
        "output_norm.weight": (H,),
    }
    if not s.tied:
        shapes["output.weight"] = (H, s.vocab)
    per_layer = layer_parts(s.arch)
    for i in range(s.layers):
        for name, key in per_layer.items():
            shapes[f"blk.{i}.{name}"] = dims[key]
    return shapes


def _check_tensors(h: GGUFHeader, s: ModelSpec) -> None:
    per = len(layer_parts(s.arch))
    if len(h.tensors) > per * s.layers + 3:  # cheap bound before building the expected set
        raise GGUFError(f"GGUF has {len(h.tensors)} tensors, too many for {s.layers} blocks")
    if s.layers * per + 2 > len(h.tensors):
        raise GGUFError(
            f"GGUF metadata {s.arch}.block_count={s.layers} needs at least {s.layers * per + 2} "
            f"tensors, the file has {len(h.tensors)}"
        )
    want = _expected_shapes(s)
    for name, t in h.tensors.items():
        if name not in want:
            map_tensor_name(name, s.arch)  # names an unsupported tensor kind first
            raise GGUFError(f"GGUF tensor {name!r} does not belong to a {s.layers}-block model")
        if t.dims != want[name]:
            raise GGUFError(
                f"GGUF tensor {name!r} has dims {list(t.dims)}, expected {list(want[name])} "
                "from the metadata"
            )
        if len(t.dims) == 1 and t.type_name not in _FLOAT_1D:
            raise GGUFError(f"GGUF tensor {name!r} is 1-D but stored as {t.type_name}")
    missing = [n for n in want if n not in h.tensors]
    if missing:
        raise GGUFError(f"GGUF lacks tensor {missing[0]!r} ({len(missing)} missing)")


def _heads(h: GGUFHeader, p: str, arch: str) -> tuple[int, int, int, int]:
    heads = _int(h, p + "attention.head_count")
    kv = _int(h, p + "attention.head_count_kv", heads)
    if heads % kv:
        raise GGUFError(
            f"GGUF metadata {p}attention.head_count_kv={kv} does not divide "
            f"{p}attention.head_count={heads}"
        )
    hidden = _int(h, p + "embedding_length")
    if p + "attention.key_length" not in h.metadata and hidden % heads:
        raise GGUFError(
            f"GGUF metadata {p}embedding_length={hidden} is not a multiple of "
            f"{p}attention.head_count={heads}"
        )
    head_dim = _int(h, p + "attention.key_length", hidden // heads)
    vdim = _int(h, p + "attention.value_length", head_dim)
    if vdim != head_dim:
        raise GGUFError(f"GGUF metadata {p}attention.value_length={vdim} != key_length {head_dim}")
    if arch == "qwen2" and head_dim * heads != hidden:  # mlx_lm's qwen2 derives head_dim
        raise GGUFError(f"GGUF metadata {p}attention.key_length={head_dim} != hidden / heads")
    return hidden, heads, kv, head_dim


def check_model(h: GGUFHeader) -> ModelSpec:
    """Validate ``h`` as a model of a supported family; return its hyperparameters."""
    _str(h, "general.architecture", FAMILIES, True)
    arch = h.metadata["general.architecture"]
    p = arch + "."
    hidden, heads, kv, head_dim = _heads(h, p, arch)
    layers = _int(h, p + "block_count")
    ffn = _int(h, p + "feed_forward_length")
    _int(h, p + "context_length", 4096)
    _int(h, p + "attention.sliding_window", 4096)
    _float(h, p + "attention.layer_norm_rms_epsilon", 0.0, 1.0)
    _float(h, p + "rope.freq_base", 0.0, 1e12)
    _str(h, p + "rope.scaling.type", ("none", "linear"), False)
    if h.metadata.get(p + "rope.scaling.type") == "linear":
        _float(h, p + "rope.scaling.factor", 0.0, 1e6)
        if p + "rope.scaling.factor" not in h.metadata:
            raise GGUFError(f"GGUF metadata lacks {p}rope.scaling.factor")
    n_tokens = _tokenizer(h)
    vocab = _int(h, p + "vocab_size", n_tokens)
    if n_tokens > vocab:
        raise GGUFError(
            f"GGUF has {n_tokens} tokens but {p}vocab_size={vocab}: token ids would be "
            "out of range of the embedding"
        )
    tied = "output.weight" not in h.tensors
    spec = ModelSpec(arch, hidden, layers, ffn, heads, kv, head_dim, vocab, n_tokens, tied)
    _check_tensors(h, spec)
    return spec


check_llama = check_model  # the name the first loader used (one check for every family now)
