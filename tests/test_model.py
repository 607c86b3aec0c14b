"""The embedded SmolLM2-135M-Instruct GGUF: loader, tokenizer, generation, perplexity."""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from smollm2_fixture import embedded_gguf_path, load_embedded

pytestmark = pytest.mark.slow

PROMPT = "What is the capital of France? Answer in one sentence."
COMMON_WORDS = {"the", "is", "of", "a", "and", "in", "to", "it", "capital", "paris"}


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_embedded(True)


@pytest.fixture(scope="module")
def quantized():
    """The GPU default load (dequantize=False), once for the module."""
    from morphkv.model.gguf import load_gguf

    return load_gguf(embedded_gguf_path(), dequantize=False)


def _greedy(model, tok, max_tokens=24) -> str:
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    return mlx_lm.generate(model, tok, prompt, max_tokens=max_tokens, sampler=make_sampler(0.0))


# ---- loader ----------------------------------------------------------------------------


def test_config_matches_gguf_metadata(model_and_tokenizer):
    model, _ = model_and_tokenizer
    from mlx_lm.models import llama

    assert isinstance(model, llama.Model)
    a = model.args
    assert a.num_hidden_layers == 30 == len(model.layers)
    assert a.num_attention_heads == 9
    assert a.num_key_value_heads == 3
    assert a.hidden_size == 576
    assert a.intermediate_size == 1536
    assert a.vocab_size == 49152
    assert a.rope_theta == 100000.0
    assert a.rms_norm_eps == 1e-5
    assert a.rope_traditional is True
    assert a.tie_word_embeddings is True
    attn = model.layers[0].self_attn
    assert attn.head_dim == 64
    assert attn.k_proj.weight.shape == (192, 576)


def test_quantized_layers_are_mlx_8_bit(quantized):
    """dequantize=False (the GPU default): every quantized GGUF tensor becomes MLX 8-bit,
    group 32 (re-rounding the file's 4-bit grid onto MLX's 4-bit one doubled its error)."""
    model, meta = quantized
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert model.model.embed_tokens.bits == 8
    for lin in (
        model.layers[0].self_attn.q_proj,
        model.layers[29].self_attn.v_proj,
        model.layers[5].mlp.down_proj,
    ):
        assert isinstance(lin, nn.QuantizedLinear)
        assert lin.bits == 8 and lin.group_size == 32
    assert meta["general.architecture"] == "llama"


def test_dequantized_matches_quantized(model_and_tokenizer, quantized):
    dense, _ = model_and_tokenizer
    quant, _ = quantized
    x = mx.array([[1, 9690, 198, 2683, 359, 253]])
    a, b = dense(x), quant(x).astype(mx.float32)
    assert mx.argmax(a, -1).tolist() == mx.argmax(b, -1).tolist()
    assert mx.abs(a - b).max().item() < 0.1 * mx.abs(a).max().item()


def test_tensor_name_mapping():
    from morphkv.model.gguf import GGUFError, map_tensor_name

    assert map_tensor_name("blk.3.attn_q.scales") == "model.layers.3.self_attn.q_proj.scales"
    assert map_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert map_tensor_name("blk.7.ffn_norm.weight") == (
        "model.layers.7.post_attention_layernorm.weight"
    )
    assert map_tensor_name("token_embd.biases") == "model.embed_tokens.biases"
    assert map_tensor_name("output_norm.weight") == "model.norm.weight"
    assert map_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(GGUFError):
        map_tensor_name("blk.0.attn_qkv.weight")


# ---- tokenizer -------------------------------------------------------------------------


def test_tokenizer_special_tokens_and_roundtrip(model_and_tokenizer):
    _, tok = model_and_tokenizer
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert 2 in tok.eos_token_ids
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[:1] == [1]
    assert 2 in tok.encode("x<|im_end|>")
    text = "Hello world, it's 2024!\n  indented\tcode: naïve café ✓"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("2024") == [34, 32, 34, 36]  # digits split one by one (smollm)
    assert tok.encode("Hello world") == [19556, 905]


def test_chat_template(model_and_tokenizer):
    _, tok = model_and_tokenizer
    assert tok.has_chat_template
    s = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert s.startswith("<|im_start|>system\n")
    assert s.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_streaming_detokenizer_matches_decode(model_and_tokenizer):
    _, tok = model_and_tokenizer
    text = "Streaming text: don't split ünïcödé or   spaces.\nNew line."
    ids = tok.encode(text)
    d = tok.detokenizer
    d.reset()
    for t in ids:
        d.add_token(t)
    d.finalize()
    assert d.text == tok.decode(ids)


# ---- behaviour -------------------------------------------------------------------------


def test_greedy_is_deterministic_english(model_and_tokenizer):
    model, tok = model_and_tokenizer
    a = _greedy(model, tok)
    b = _greedy(model, tok)
    assert a == b
    assert len(a.strip()) > 10
    letters = sum(ch.isascii() and (ch.isalpha() or ch.isspace()) for ch in a)
    assert letters / len(a) > 0.8, a
    words = set(re.findall(r"[a-z]+", a.lower()))
    assert len(words & COMMON_WORDS) >= 2, a
    assert "paris" in words, a


_PPL_SCRIPT = """
import json, math, sys
import mlx.core as mx, mlx.nn as nn
from pydoc_data.topics import topics
from morphkv.model import load_gguf_model

path, n = sys.argv[1], int(sys.argv[2])
text = "\\n\\n".join(topics[k] for k in ("exceptions", "for", "with"))
out = {}
for rt in (True, False):
    model, tok = load_gguf_model(path, rope_traditional=rt)
    x = mx.array(tok.encode(text)[:n])[None]
    logits = model(x[:, :-1]).astype(mx.float32)
    loss = nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")
    out[str(rt)] = math.exp(loss.item())
print(json.dumps(out))
"""


def test_perplexity_sane_and_wrong_rope_layout_is_much_worse():
    """Teacher-forced perplexity of Python-docs prose (512 tokens). Run in a subprocess with
    the OpenBLAS preload (a 512-token forward is ~20x slower with MLX's reference BLAS)."""
    import json
    import subprocess
    import sys

    from morphkv.runtime.blas import blas_env

    path = embedded_gguf_path()
    proc = subprocess.run(
        [sys.executable, "-c", _PPL_SCRIPT, path, "512"],
        env=blas_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ppl = json.loads(proc.stdout.strip().splitlines()[-1])
    good, bad = ppl["True"], ppl["False"]
    print(f"perplexity rope_traditional=True {good:.2f}, False {bad:.2f}")
    assert 4.0 < good < 40.0, ppl
    assert bad > 3 * good, ppl


def test_load_dispatch(monkeypatch, tmp_path):
    import mlx_lm

    import morphkv.model as mm

    seen = {}
    monkeypatch.setattr(mlx_lm, "load", lambda m: (seen.setdefault("m", m), "tok", "cfg"))
    assert mm.load("some/hf-repo") == ("some/hf-repo", "tok")
    with pytest.raises(FileNotFoundError):
        mm.load(str(tmp_path / "missing.gguf"))
    monkeypatch.setattr(mm, "resolve_default_gguf", lambda: "/x/default.gguf")
    monkeypatch.setattr(mm, "load_gguf_model", lambda p, rope_traditional=True: ("model", p))
    assert mm.load(None) == ("model", "/x/default.gguf")


def test_load_none_gives_embedded_model():
    embedded_gguf_path()
    from morphkv.model import load

    model, tok = load()
    assert model.args.num_hidden_layers == 30
    ids = np.array(tok.encode("The quick brown fox"))
    assert ids.size == 4
