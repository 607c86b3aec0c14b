"""The SentencePiece tokenizer rebuilt from GGUF metadata with ``tokenizers`` matches
``sentencepiece`` itself token for token (a tiny vocabulary with byte fallback here; the real
Gemma vocabulary in tests/test_gemma.py, opt-in)."""

from __future__ import annotations

import pytest

from morphkv.model.gguf_tiny import spm_tokenizer_meta
from morphkv.model.tokenizer import PLAIN_TEMPLATE, build_tokenizer
from morphkv.model.tokenizer_spm import build_spm_tokenizer, spm_model_proto

VARIED = [
    "Hello world", " leading space", "two  spaces and\ttab\n\nnewlines\n", "trailing   ",
    "digits 1234567890 3.14159 -42", "emoji 😀👍🏽 and 🇫🇷 flags", "naïve café ✓ 日本語のテキスト",
    "unknown bytes \x00\x01\x7f \ufffe 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "    indented code:\n\tif x:\n\t\treturn 1",
    "<b>bold</b> <div>x</div>", "", "a", "   ", "\n", "x\u00a0y", "don't can't it's",
    "https://example.com/path?q=1&r=2", "The quick brown fox jumps over the lazy dog. " * 3,
    "abc ab a b c  abcabc\n\nab",
]  # fmt: skip


def tiny_meta() -> dict:
    return {m.key: m.value for m in spm_tokenizer_meta()}


def check_against_sentencepiece(meta: dict, texts: list[str]) -> None:
    import sentencepiece as spm

    hf = build_spm_tokenizer(meta)
    sp = spm.SentencePieceProcessor(model_proto=spm_model_proto(meta))
    for text in texts:
        ours = hf.encode(text, add_special_tokens=False)
        assert ours == sp.encode(text), (text, hf.convert_ids_to_tokens(ours))
        assert hf.decode(ours) == sp.decode(ours) == text, text


def test_tiny_vocabulary_matches_sentencepiece():
    check_against_sentencepiece(tiny_meta(), VARIED)


def test_bos_added_control_tokens_whole_and_eos():
    tok = build_tokenizer(tiny_meta())
    ids = tok.encode("ab")
    assert ids[0] == 2 and tok.bos_token_id == 2 and tok.eos_token_ids == {1}
    # control tokens in text are encoded whole (as llama.cpp does; sentencepiece never does)
    assert tok.encode("<start_of_turn>ab", add_special_tokens=False)[0] == 4


def test_streaming_detokenizer_matches_decode():
    tok = build_tokenizer(tiny_meta())
    text = "abc  ab\n\n😀 c"
    ids = tok.encode(text, add_special_tokens=False)
    d = tok.detokenizer
    d.reset()
    for t in ids:
        d.add_token(t)
    d.finalize()
    assert d.text == tok.decode(ids) == text


def test_base_model_gets_a_plain_text_template():
    tok = build_tokenizer(tiny_meta())
    assert tok.chat_template == PLAIN_TEMPLATE
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<bos>User: Hi\n\nAssistant:"
    ids = tok.apply_chat_template([{"role": "user", "content": "ab"}], add_generation_prompt=True)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_inconsistent_lengths_are_a_gguf_error():
    from morphkv.model import GGUFError

    meta = tiny_meta()
    meta["tokenizer.ggml.scores"] = meta["tokenizer.ggml.scores"][:-1]
    with pytest.raises(GGUFError, match="differ in length"):
        build_spm_tokenizer(meta)
