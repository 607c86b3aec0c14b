"""The real Gemma 3 270M (opt-in: MORPHKV_GEMMA=1; fetched once, 253 MB): configuration from the
GGUF, tokenizer token for token against sentencepiece, logits against an independent float32
dequantization loaded by mlx_lm itself, coherent greedy prose, perplexity. Figures print with
``pytest -s``."""

from __future__ import annotations

import json
import math
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("MORPHKV_GEMMA") != "1", reason="set MORPHKV_GEMMA=1"),
]
PROSE = "The history of the printing press begins in"


@pytest.fixture(scope="module")
def path():
    from morphkv.model import resolve_embedded

    return str(resolve_embedded("gemma3-270m"))


@pytest.fixture(scope="module")
def loaded(path):
    from morphkv.model import load_gguf_model

    return load_gguf_model(path)


def test_config_from_the_gguf(loaded):
    from mlx_lm.models import gemma3_text

    model, tok = loaded
    a = model.args
    assert isinstance(model, gemma3_text.Model)
    got = (a.num_hidden_layers, a.hidden_size, a.num_attention_heads, a.num_key_value_heads,
           a.head_dim, a.sliding_window, a.vocab_size)  # fmt: skip
    assert got == (18, 640, 4, 1, 256, 512, 262144)
    kinds = [type(c).__name__ for c in model.make_cache()]
    assert [i for i, k in enumerate(kinds) if k == "KVCache"] == [5, 11, 17]
    assert tok.bos_token_id == 2 and 1 in tok.eos_token_ids


def test_tokenizer_matches_sentencepiece(path):
    from gguf import GGUFReader
    from test_tokenizer_spm import VARIED, check_against_sentencepiece

    from morphkv.model.gguf import read_metadata

    meta = read_metadata(GGUFReader(path))
    check_against_sentencepiece(meta, VARIED)


def _independent_model(path, tmp_path):
    """Every tensor dequantized to float32 by the gguf library, renamed by hand, written as a
    safetensors model folder and loaded by ``mlx_lm.utils.load_model`` (its own config
    parsing and model build)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from mlx_lm.utils import load_model

    r = GGUFReader(path)
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}  # fmt: skip
    weights = {}
    for t in r.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        if t.name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp's Gemma converter stores 1 + w
        if t.name.startswith("blk."):
            _, i, part, _ = t.name.split(".")
            key = f"model.layers.{i}.{names[part]}.weight"
        else:
            key = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight"}[t.name]  # fmt: skip
        weights[key] = mx.array(w)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    config = {"model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 18,
              "intermediate_size": 2048, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": 262144,
              "rope_theta": 1e6, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 256,
              "sliding_window": 512, "sliding_window_pattern": 6}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, _ = load_model(tmp_path)
    return model


def test_logits_match_an_independent_float32_load(path, loaded, tmp_path):
    from morphkv.model.gguf import load_gguf

    model, tok = loaded
    ref = _independent_model(path, tmp_path)
    x = mx.array([tok.encode(PROSE)])
    want = ref(x)
    got = model(x)
    quant, _ = load_gguf(path, dequantize=False)  # MLX 8-bit, the GPU default
    got8 = quant(x).astype(mx.float32)
    d32, d8 = mx.abs(got - want).max().item(), mx.abs(got8 - want).max().item()
    span = mx.abs(want).max().item()
    print(f"\nmax |logit diff| vs independent float32: dense {d32:.2e}, MLX 8-bit {d8:.3f} "
          f"(max |logit| {span:.1f})")  # fmt: skip
    assert d32 < 1e-3 * span
    assert d8 < 0.05 * span
    assert mx.argmax(got8[0, -1]).item() == mx.argmax(want[0, -1]).item()


def test_greedy_prose_is_coherent(loaded):
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tok = loaded
    text = mlx_lm.generate(model, tok, PROSE, max_tokens=40, sampler=make_sampler(0.0))
    print(f"\n{PROSE}{text}")
    words = text.lower().split()
    assert len(words) >= 20 and {"the", "printing", "press"} <= set(words), text
    assert len(set(words)) > 0.4 * len(words), text


def test_perplexity_on_held_out_prose(loaded):
    from pydoc_data.topics import topics

    model, tok = loaded
    text = "\n\n".join(topics[k] for k in ("exceptions", "for", "with"))
    x = mx.array(tok.encode(text)[:512])[None]
    loss = nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:], reduction="mean")
    ppl = math.exp(loss.item())
    print(f"\nperplexity, 512 tokens of Python-docs prose: {ppl:.2f}")
    assert 3.0 < ppl < 40.0
