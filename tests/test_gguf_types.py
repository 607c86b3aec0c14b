"""Generated GGUF files of the gemma3, llama, qwen2 and qwen3 families, one per tensor type, are
loaded and compared against the ``gguf`` library's own dequantization of the same bytes: dense
weights exactly, MLX 8-bit weights within one MLX step of them (RMS error under 1%). Every file
also runs a forward pass (CI never downloads a real model for this)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from morphkv.model import load_gguf_model
from morphkv.model.gguf import load_gguf
from morphkv.model.gguf_names import map_tensor_name
from morphkv.model.gguf_tensors import dequantize, mlx_bits
from morphkv.model.gguf_tiny import tiny_gguf

FAMILIES = ("gemma3", "llama", "qwen2", "qwen3")
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # fmt: skip
# row lengths of 256: the K-quants' block size
SIZES = dict(hidden=256, heads=2, kv_heads=1, ffn=256, layers=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("types")
    out = {}
    for arch in FAMILIES:
        for ttype in TYPES:
            p = root / f"{arch}-{ttype}.gguf"
            kw = {**SIZES, "layers": 6 if arch == "gemma3" else 2}  # gemma3_text needs 6
            p.write_bytes(tiny_gguf(arch, ttype=ttype, seed=len(out), **kw))
            out[arch, ttype] = p
    return out


def _reference(path) -> dict:
    from gguf import GGUFReader

    return {t.name: (t.tensor_type.name, dequantize(t)) for t in GGUFReader(path).tensors}


def _params(model) -> dict:
    return dict(tree_flatten(model.parameters()))


@pytest.mark.parametrize("arch", FAMILIES)
def test_dense_weights_equal_the_librarys_dequantization(files, arch):
    for ttype in TYPES:
        model, _ = load_gguf(files[arch, ttype], dequantize=True)
        params = _params(model)
        for name, (_t, ref) in _reference(files[arch, ttype]).items():
            got = np.array(params[map_tensor_name(name, arch)])
            shift = 1.0 if arch == "gemma3" and name.endswith("norm.weight") else 0.0
            assert got.dtype == np.float32, (arch, ttype, name)
            np.testing.assert_array_equal(got, ref - np.float32(shift), err_msg=f"{arch} {name}")


def _dequantized(module) -> np.ndarray:
    w = mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)
    return np.array(w.astype(mx.float32))


@pytest.mark.parametrize("arch", ("gemma3", "llama"))
def test_quantized_weights_within_one_step(files, arch):
    for ttype in TYPES:
        model, _ = load_gguf(files[arch, ttype], dequantize=False)
        modules = dict(model.named_modules())
        for name, (t, ref) in _reference(files[arch, ttype]).items():
            if ref.ndim == 1:
                continue
            path = map_tensor_name(name, arch).rsplit(".", 1)[0]
            m = modules[path]
            if t in ("F32", "F16", "BF16"):
                assert not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                np.testing.assert_array_equal(np.array(m.weight.astype(mx.float32)), ref)
                continue
            assert m.bits == mlx_bits(t) and m.group_size == 32, (name, t, m.bits)
            step = np.repeat(np.array(m.scales.astype(mx.float32)), 32, axis=-1)
            err = np.abs(_dequantized(m) - ref)
            assert (err <= np.abs(step) * 1.001 + 1e-7).all(), (arch, t, name, err.max())
            assert np.sqrt((err**2).mean()) < 0.01 * np.sqrt((ref**2).mean()), (arch, t, name)


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_type_runs_a_forward_pass(files, arch):
    for ttype in TYPES:
        model, tok = load_gguf_model(files[arch, ttype])
        ids = tok.encode("ab abc")
        logits = model(mx.array([ids]))
        assert logits.shape[:2] == (1, len(ids)) and mx.isfinite(logits).all().item(), ttype


def test_families_map_to_mlx_lm_classes(files):
    from mlx_lm.models import gemma3_text, llama, qwen2, qwen3

    want = {"gemma3": gemma3_text, "llama": llama, "qwen2": qwen2, "qwen3": qwen3}
    for arch, mod in want.items():
        model, _ = load_gguf(files[arch, "Q8_0"])
        assert isinstance(model, mod.Model), arch
    gemma, _ = load_gguf(files["gemma3", "Q8_0"])
    a = gemma.args
    assert (a.head_dim, a.query_pre_attn_scalar, a.sliding_window, a.sliding_window_pattern) == (
        128,
        128,
        8,
        6,
    )
    assert load_gguf(files["llama", "Q8_0"])[0].args.rope_traditional is True
    assert load_gguf(files["qwen2", "Q8_0"])[0].args.rope_traditional is False
