"""Build an mlx_lm ``TokenizerWrapper`` from the tokenizer stored in GGUF metadata.

Supports ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE, as used by SmolLM2, Llama 3,
Qwen, ...) here, and ``"llama"`` (SentencePiece: Gemma ...) in ``tokenizer_spm``. Control
tokens (token_type 3) and user-defined tokens (4) become added tokens so ``<|im_start|>`` /
``<|im_end|>`` are encoded whole.

A file without a chat template (a base model such as Gemma 3 270M) gets ``PLAIN_TEMPLATE``:
BOS (templates carry it: mlx_lm's server and chat tokenize the rendered text without adding
special tokens, and Gemma without BOS answers "Assistant:" again and again), then the messages
as plain text, one ``Role: content`` paragraph each, ending with ``Assistant:`` when a reply is
wanted, so ``morphkv chat`` and ``serve`` accept it; a base model then simply continues a
transcript.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .gguf_header import GGUFError

# llama.cpp pre-tokenizer regexes (llama-vocab.cpp), keyed by tokenizer.ggml.pre
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PLAIN_TEMPLATE = (
    "{{ bos_token or '' }}"
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


class GGUFTokenizerError(GGUFError):
    """The tokenizer stored in the GGUF metadata is unsupported or inconsistent."""


def _get(meta: dict, key: str, default: Any = None) -> Any:
    v = meta.get(key, default)
    if isinstance(v, mx.array):
        v = v.tolist() if v.ndim else v.item()
    return v


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # digits one by one, then the GPT-2 regex
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "falcon3"):
        regex = _LLAMA3_RE
    elif pre in ("qwen2", "deepseek-r1-qwen"):
        regex = _QWEN2_RE
    else:  # "gpt2", "default", unknown
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False), byte_level]
    )


def build_hf_tokenizer(meta: dict[str, Any]):
    """A ``transformers.PreTrainedTokenizerFast`` built from GGUF tokenizer metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = _get(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')"
        )
    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFTokenizerError("GGUF metadata lacks the vocabulary 'tokenizer.ggml.tokens'")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges_raw: list[str] = list(meta.get("tokenizer.ggml.merges", []))
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    known = set(tokens)
    for i, m in enumerate(merges):
        if len(m) != 2 or not {m[0], m[1], m[0] + m[1]} <= known:
            raise GGUFTokenizerError(
                f"GGUF metadata tokenizer.ggml.merges[{i}]={merges_raw[i]!r} is not "
                "'<left> <right>' with both parts and the merged token in the vocabulary"
            )
    types = _get(meta, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}

    try:
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    except Exception as e:  # tokenizers raises a bare Exception
        raise GGUFTokenizerError(f"GGUF tokenizer cannot be built: {str(e)[:200]}") from e
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(_get(meta, "tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    if special:
        tok.add_special_tokens(special)

    def tok_of(key: str) -> str | None:
        i = _get(meta, key)
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise GGUFTokenizerError(
                f"GGUF metadata {key}={i} is not a token id (0..{len(tokens) - 1})"
            )
        return tokens[int(i)]

    kwargs = {
        "bos_token": tok_of("tokenizer.ggml.bos_token_id"),
        "eos_token": tok_of("tokenizer.ggml.eos_token_id"),
        "unk_token": tok_of("tokenizer.ggml.unknown_token_id"),
        "pad_token": tok_of("tokenizer.ggml.padding_token_id"),
    }
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    chat_template = _get(meta, "tokenizer.chat_template")
    if chat_template:
        kwargs["chat_template"] = chat_template
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kwargs)
    if _get(meta, "tokenizer.ggml.add_bos_token", False) and hf.bos_token_id is not None:
        # prepend BOS like llama.cpp does
        hf._tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{hf.bos_token} $A",
                    pair=f"{hf.bos_token} $A {hf.bos_token} $B",
                    special_tokens=[(hf.bos_token, hf.bos_token_id)],
                ),
            ]
        )
    return hf


def build_tokenizer(meta: dict[str, Any]):
    """An mlx_lm ``TokenizerWrapper`` (byte-level BPE or SentencePiece streaming detokenizer)."""
    from mlx_lm.tokenizer_utils import (
        BPEStreamingDetokenizer,
        SPMStreamingDetokenizer,
        TokenizerWrapper,
    )

    if _get(meta, "tokenizer.ggml.model") == "llama":
        from .tokenizer_spm import build_spm_tokenizer

        hf = build_spm_tokenizer(meta)
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        detok = lambda t: SPMStreamingDetokenizer(t, trim_space=prefix)  # noqa: E731
    else:
        hf, detok = build_hf_tokenizer(meta), BPEStreamingDetokenizer
    if not hf.chat_template:
        hf.chat_template = PLAIN_TEMPLATE
    eos = set()
    if hf.eos_token_id is not None:
        eos.add(hf.eos_token_id)
    eot = _get(meta, "tokenizer.ggml.eot_token_id")
    if eot is not None:
        if not 0 <= int(eot) < hf.vocab_size:
            raise GGUFTokenizerError(
                f"GGUF metadata tokenizer.ggml.eot_token_id={eot} is out of range"
            )
        eos.add(int(eot))
    return TokenizerWrapper(hf, detok, eos_token_ids=sorted(eos))
