"""Check a parsed GGUF header describes a Llama model this loader can build, before building it.

Required metadata (architecture, sizes, head counts, vocabulary, EOS id) must be present, of
the right type and in range, and the tensors must be exactly the ones a Llama model of those
sizes has, each with the shape the metadata implies. Nothing here touches MLX.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .gguf_header import FLOAT_TYPES, INT_TYPES, GGUFArray, GGUFError, GGUFHeader

P = "llama."
MAX_SIZE = 1 << 31  # any single hyperparameter

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
_TOKEN_IDS = ("bos", "eos", "unknown", "padding", "eot", "eom", "sep", "cls", "mask")


def map_tensor_name(name: str) -> str:
    """GGUF tensor name -> mlx_lm llama parameter name."""
    m = _BLK_RE.match(name)
    if m:
        idx, part, kind = m.groups()
        if part not in _LAYER_MAP:
            raise GGUFError(f"unsupported GGUF tensor {name}")
        return f"model.layers.{int(idx)}.{_LAYER_MAP[part]}.{kind}"
    m = _TOP_RE.match(name)
    if m and m.group(1) in _TOP_MAP:
        return f"{_TOP_MAP[m.group(1)]}.{m.group(2)}"
    raise GGUFError(f"unsupported GGUF tensor {name}")


@dataclass(frozen=True)
class LlamaSpec:
    """The hyperparameters of a checked GGUF header."""

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
    _str(h, "tokenizer.ggml.model", ("gpt2",), True)
    _str(h, "tokenizer.ggml.pre", None, False)
    _str(h, "tokenizer.chat_template", None, False)
    n = _array(h, "tokenizer.ggml.tokens", "string", None, True).count
    _array(h, "tokenizer.ggml.token_type", INT_TYPES, n, False)
    _array(h, "tokenizer.ggml.merges", "string", None, False)
    _int(h, "tokenizer.ggml.eos_token_id", lo=0)  # required: else generation never stops
    for name in _TOKEN_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        if key in h.metadata and not 0 <= _int(h, key, lo=0) < n:
            raise GGUFError(f"GGUF metadata {key}={h.metadata[key]} is not a token id (0..{n - 1})")
    return n


def _expected_shapes(s: LlamaSpec) -> dict[str, tuple[int, ...]]:
    """Tensor name -> GGUF dims (innermost first) for a Llama model of spec ``s``."""
    H, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (H, s.vocab),
        "output_norm.weight": (H,),
    }
    if not s.tied:
        shapes["output.weight"] = (H, s.vocab)
    per_layer = {
        "attn_q": (H, q),
        "attn_k": (H, kv),
        "attn_v": (H, kv),
        "attn_output": (q, H),
        "ffn_gate": (H, s.ffn),
        "ffn_up": (H, s.ffn),
        "ffn_down": (s.ffn, H),
        "attn_norm": (H,),
        "ffn_norm": (H,),
    }
    for i in range(s.layers):
        for part, dims in per_layer.items():
            shapes[f"blk.{i}.{part}.weight"] = dims
    return shapes


def _check_tensors(h: GGUFHeader, s: LlamaSpec) -> None:
    if len(h.tensors) > 9 * s.layers + 3:  # cheap bound before building the expected set
        raise GGUFError(f"GGUF has {len(h.tensors)} tensors, too many for {s.layers} blocks")
    if s.layers * 9 + 2 > len(h.tensors):
        raise GGUFError(
            f"GGUF metadata llama.block_count={s.layers} needs at least {s.layers * 9 + 2} "
            f"tensors, the file has {len(h.tensors)}"
        )
    want = _expected_shapes(s)
    for name, t in h.tensors.items():
        if name not in want:
            map_tensor_name(name)  # names an unsupported tensor kind first
            raise GGUFError(f"GGUF tensor {name!r} does not belong to a {s.layers}-block model")
        if t.dims != want[name]:
            raise GGUFError(
                f"GGUF tensor {name!r} has dims {list(t.dims)}, expected {list(want[name])} "
                "from the metadata"
            )
        if len(t.dims) == 1 and t.type_name not in ("F32", "F16"):
            raise GGUFError(f"GGUF tensor {name!r} is 1-D but stored as {t.type_name}")
    missing = [n for n in want if n not in h.tensors]
    if missing:
        raise GGUFError(f"GGUF lacks tensor {missing[0]!r} ({len(missing)} missing)")


def check_llama(h: GGUFHeader) -> LlamaSpec:
    """Validate ``h`` as a Llama-family model; return its hyperparameters."""
    _str(h, "general.architecture", ("llama",), True)
    heads = _int(h, P + "attention.head_count")
    kv = _int(h, P + "attention.head_count_kv", heads)
    if heads % kv:
        raise GGUFError(
            f"GGUF metadata {P}attention.head_count_kv={kv} does not divide "
            f"{P}attention.head_count={heads}"
        )
    hidden = _int(h, P + "embedding_length")
    if P + "attention.key_length" not in h.metadata and hidden % heads:
        raise GGUFError(
            f"GGUF metadata {P}embedding_length={hidden} is not a multiple of "
            f"{P}attention.head_count={heads}"
        )
    head_dim = _int(h, P + "attention.key_length", hidden // heads)
    vdim = _int(h, P + "attention.value_length", head_dim)
    if vdim != head_dim:
        raise GGUFError(f"GGUF metadata {P}attention.value_length={vdim} != key_length {head_dim}")
    layers = _int(h, P + "block_count")
    ffn = _int(h, P + "feed_forward_length")
    _int(h, P + "context_length", 4096)
    _float(h, P + "attention.layer_norm_rms_epsilon", 0.0, 1.0)
    _float(h, P + "rope.freq_base", 0.0, 1e12)
    _str(h, P + "rope.scaling.type", ("none", "linear"), False)
    if h.metadata.get(P + "rope.scaling.type") == "linear":
        _float(h, P + "rope.scaling.factor", 0.0, 1e6)
        if P + "rope.scaling.factor" not in h.metadata:
            raise GGUFError(f"GGUF metadata lacks {P}rope.scaling.factor")
    n_tokens = _tokenizer(h)
    vocab = _int(h, P + "vocab_size", n_tokens)
    if n_tokens > vocab:
        raise GGUFError(
            f"GGUF has {n_tokens} tokens but {P}vocab_size={vocab}: token ids would be "
            "out of range of the embedding"
        )
    tied = "output.weight" not in h.tensors
    spec = LlamaSpec(hidden, layers, ffn, heads, kv, head_dim, vocab, n_tokens, tied)
    _check_tensors(h, spec)
    return spec
