"""Tiny random-weight GGUF models for tests: llama (byte-level BPE tokenizer), qwen2, qwen3 and
gemma3 (a SentencePiece tokenizer with byte fallback), every 2-D tensor of one chosen type."""

from __future__ import annotations

from .gguf_names import layer_parts
from .gguf_writer import Layout, Meta, Tensor, write_gguf

SPM_PIECES = ["▁", "a", "b", "c", "▁a", "ab", "▁ab", "bc", "▁abc"]


def _llama_tokenizer(pre: str = "smollm") -> list[Meta]:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<unk>", "<s>", "</s>", "Ġ", *letters, "ab", "Ġa"]
    return [
        Meta("tokenizer.ggml.model", "string", "gpt2"),
        Meta("tokenizer.ggml.pre", "string", pre),
        Meta("tokenizer.ggml.tokens", "array", tokens, "string"),
        Meta("tokenizer.ggml.token_type", "array", [3, 3, 3] + [1] * (len(tokens) - 3), "int32"),
        Meta("tokenizer.ggml.merges", "array", ["a b", "Ġ a"], "string"),
        Meta("tokenizer.ggml.bos_token_id", "uint32", 1),
        Meta("tokenizer.ggml.eos_token_id", "uint32", 2),
    ]


def spm_tokenizer_meta() -> list[Meta]:
    """A SentencePiece vocabulary like Gemma's: control tokens, 256 byte tokens, a few pieces
    (scores rank the merges), a user-defined newline; BOS added, no space prefix."""
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens = control + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + ["\n"]
    types = [3] * len(control) + [6] * 256 + [1] * len(SPM_PIECES) + [4]
    scores = [0.0] * (len(control) + 256) + [-float(i) for i in range(len(SPM_PIECES))] + [0.0]
    return [
        Meta("tokenizer.ggml.model", "string", "llama"),
        Meta("tokenizer.ggml.pre", "string", "default"),
        Meta("tokenizer.ggml.tokens", "array", tokens, "string"),
        Meta("tokenizer.ggml.scores", "array", scores, "float32"),
        Meta("tokenizer.ggml.token_type", "array", types, "int32"),
        Meta("tokenizer.ggml.bos_token_id", "uint32", 2),
        Meta("tokenizer.ggml.eos_token_id", "uint32", 1),
        Meta("tokenizer.ggml.unknown_token_id", "uint32", 3),
        Meta("tokenizer.ggml.padding_token_id", "uint32", 0),
        Meta("tokenizer.ggml.add_bos_token", "bool", True),
        Meta("tokenizer.ggml.add_space_prefix", "bool", False),
    ]


def n_tokens(arch: str) -> int:
    return 6 + 256 + len(SPM_PIECES) + 1 if arch == "gemma3" else 32


def tiny_meta(
    arch: str = "llama", *, hidden: int = 32, layers: int = 2, heads: int = 2, kv_heads: int = 1,
    ffn: int = 32, head_dim: int | None = None,
) -> list[Meta]:  # fmt: skip
    p = arch + "."
    meta = [
        Meta("general.architecture", "string", arch),
        Meta(p + "block_count", "uint32", layers),
        Meta(p + "context_length", "uint32", 256),
        Meta(p + "embedding_length", "uint32", hidden),
        Meta(p + "feed_forward_length", "uint32", ffn),
        Meta(p + "attention.head_count", "uint32", heads),
        Meta(p + "attention.head_count_kv", "uint32", kv_heads),
        Meta(p + "rope.freq_base", "float32", 10000.0),
        Meta(p + "attention.layer_norm_rms_epsilon", "float32", 1e-5),
    ]
    if head_dim is not None:
        meta.append(Meta(p + "attention.key_length", "uint32", head_dim))
        meta.append(Meta(p + "attention.value_length", "uint32", head_dim))
    if arch == "gemma3":
        meta.append(Meta(p + "attention.sliding_window", "uint32", 8))
        return meta + spm_tokenizer_meta()
    return meta + _llama_tokenizer("smollm" if arch == "llama" else "qwen2")


def tiny_tensors(
    arch: str = "llama", *, hidden: int = 32, layers: int = 2, heads: int = 2, kv_heads: int = 1,
    ffn: int = 32, head_dim: int | None = None, vocab: int | None = None, tied: bool = False,
    ttype: str = "Q8_0",
) -> list[Tensor]:  # fmt: skip
    """Every 2-D tensor of type ``ttype``, every 1-D one F32."""
    hd = head_dim or hidden // heads
    dims = {"H": (hidden,), "q": (heads * hd,), "kv": (kv_heads * hd,), "hd": (hd,),
            "H,q": (hidden, heads * hd), "H,kv": (hidden, kv_heads * hd),
            "q,H": (heads * hd, hidden),
            "H,ffn": (hidden, ffn), "ffn,H": (ffn, hidden)}  # fmt: skip
    vocab = vocab or n_tokens(arch)
    ts = [Tensor("token_embd.weight", (hidden, vocab), ttype)]
    for i in range(layers):
        for name, key in layer_parts(arch).items():
            d = dims[key]
            ts.append(Tensor(f"blk.{i}.{name}", d, ttype if len(d) == 2 else "F32"))
    ts.append(Tensor("output_norm.weight", (hidden,), "F32"))
    if not tied:
        ts.append(Tensor("output.weight", (hidden, vocab), ttype))
    return ts


def tiny_gguf(arch: str = "llama", *, ttype: str = "Q8_0", seed: int = 0, **kw) -> bytes:
    """A valid tiny GGUF of family ``arch`` (random weights, every 2-D tensor ``ttype``)."""
    meta_keys = ("hidden", "layers", "heads", "kv_heads", "ffn", "head_dim")
    meta = tiny_meta(arch, **{k: v for k, v in kw.items() if k in meta_keys})
    return write_gguf(meta, tiny_tensors(arch, ttype=ttype, **kw), seed=seed)[0]


# --- the first tiny model (hostile and fuzz tests corrupt its header field by field) -------


def tiny_llama_meta(
    *, hidden: int = 32, layers: int = 2, heads: int = 2, kv_heads: int = 1, ffn: int = 32
) -> list[Meta]:
    return tiny_meta("llama", hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn)


def tiny_llama_tensors(
    *, hidden: int = 32, layers: int = 2, heads: int = 2, kv_heads: int = 1, ffn: int = 32,
    vocab: int = 32, tied: bool = False,
) -> list[Tensor]:  # fmt: skip
    """A mix of types: Q8_0 embedding, Q4_1 / Q4_0 / Q8_0 / F16 / F32 projections."""
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
