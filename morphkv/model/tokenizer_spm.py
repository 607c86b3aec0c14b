"""A SentencePiece tokenizer (``tokenizer.ggml.model == "llama"``: Gemma, Llama 2, Mistral ...)
rebuilt from GGUF metadata with ``tokenizers``, the way transformers converts SentencePiece BPE
models (its ``SentencePieceExtractor`` and Gemma converter):

- the vocabulary is the GGUF's tokens; merges are every split ``a + b`` of a normal piece into
  two pieces of the vocabulary, ranked by the merged piece's score (SentencePiece BPE merges the
  pair whose result scores highest);
- spaces become ``▁`` (a normalizer), with a leading ``▁`` only when ``add_space_prefix``;
- byte fallback: a character outside the vocabulary becomes its UTF-8 bytes ``<0xNN>``;
- control tokens (type 3) are special added tokens, user-defined ones (type 4: Gemma's runs of
  newlines, spaces and tabs, HTML tags) plain added tokens matched whole in the raw text
  (llama.cpp stores their ``▁`` as a space);
- ``add_bos_token`` prepends BOS.

``tests/test_tokenizer_spm.py`` checks it token for token against ``sentencepiece`` itself, fed
a model proto built from the same metadata (``spm_model_proto``).
"""

from __future__ import annotations

from typing import Any

from .gguf_header import GGUFError

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, UNUSED)}
    found = []
    for piece, i in vocab.items():
        if len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                found.append((-scores[i], vocab[left], vocab[right], left, right))
    found.sort()
    return [(f[3], f[4]) for f in found]


def _special_tokens(meta: dict[str, Any], tokens: list[str]) -> dict[str, str]:
    out = {}
    for name in ("bos", "eos", "unk", "pad"):
        key = f"tokenizer.ggml.{'unknown' if name == 'unk' else 'padding' if name == 'pad' else name}_token_id"  # noqa: E501
        i = meta.get(key)
        if i is not None:
            if not 0 <= int(i) < len(tokens):
                raise GGUFError(f"GGUF metadata {key}={i} is not a token id (0..{len(tokens) - 1})")
            out[f"{name}_token"] = tokens[int(i)]
    return out


def build_spm_tokenizer(meta: dict[str, Any]):
    """A ``transformers.PreTrainedTokenizerFast`` from SentencePiece GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = [float(s) for s in meta["tokenizer.ggml.scores"]]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    if not len(tokens) == len(scores) == len(types):
        raise GGUFError("GGUF tokenizer tokens, scores and token types differ in length")
    specials = _special_tokens(meta, tokens)
    unk = specials.get("unk_token")
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=_merges(tokens, scores, types),
        unk_token=unk, fuse_unk=True, byte_fallback=True,
    )  # fmt: skip
    tok = Tokenizer(bpe)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    dec = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    added = [
        AddedToken(t.replace(SPACE, " "), special=ty == CONTROL, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty in (CONTROL, USER_DEFINED)
    ]
    tok.add_tokens(added)  # keeps the GGUF ids: every added token is already in the vocab
    bos = specials.get("bos_token")
    if meta.get("tokenizer.ggml.add_bos_token", True) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))],
        )  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False, **specials
    )


def spm_model_proto(meta: dict[str, Any]) -> bytes:
    """A serialized SentencePiece ``ModelProto`` of the same metadata (the test reference)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    unk_id = int(meta.get("tokenizer.ggml.unknown_token_id", 0))
    m.trainer_spec.unk_id = unk_id
    m.trainer_spec.bos_id = int(meta.get("tokenizer.ggml.bos_token_id", -1))
    m.trainer_spec.eos_id = int(meta.get("tokenizer.ggml.eos_token_id", -1))
    m.trainer_spec.pad_id = int(meta.get("tokenizer.ggml.padding_token_id", -1))
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    types = meta["tokenizer.ggml.token_type"]
    for i, (t, s, ty) in enumerate(zip(tokens, scores, types, strict=True)):
        p = m.pieces.add()
        p.piece = t.replace(" ", SPACE) if ty == USER_DEFINED else t
        p.score = float(s)
        p.type = UNKNOWN if i == unk_id else int(ty)
    return m.SerializeToString()
