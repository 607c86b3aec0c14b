"""mlx_lm model classes and ``ModelArgs`` of a checked GGUF header, per family.

- ``llama``: ``mlx_lm.models.llama``; llama.cpp's converter permutes Q and K for its interleaved
  RoPE, so the model runs with ``rope_traditional=True``.
- ``qwen2`` / ``qwen3``: ``mlx_lm.models.qwen2`` / ``qwen3`` (NeoX RoPE, weights unpermuted).
- ``gemma3``: ``mlx_lm.models.gemma3_text``. llama.cpp stores Gemma's RMSNorm weights with the
  1 already added (Gemma scales by ``1 + w``), so ``norm_shift`` is subtracted on load. Layer
  ``i`` is a sliding-window layer unless ``(i + 1) % 6 == 0`` (llama.cpp's fixed Gemma 3 pattern;
  the file gives the window, ``attention.sliding_window``); sliding layers use RoPE base 10,000,
  global ones ``rope.freq_base``; queries are scaled by ``key_length ** -0.5`` as llama.cpp does
  for every Gemma 3 size but 27B.
"""

from __future__ import annotations

from typing import Any

from .gguf_check import ModelSpec
from .gguf_header import GGUFHeader

GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0


def f32_round(x: float) -> float:
    """1e-05 stored as float32 reads back as 9.99999974e-06; give the decimal value."""
    return float(f"{float(x):.7g}")


def norm_shift(arch: str) -> float:
    """What llama.cpp added to every ``*norm.weight`` of this family (subtract it on load)."""
    return 1.0 if arch == "gemma3" else 0.0


def _rope_scaling(meta: dict, p: str) -> dict | None:
    if meta.get(p + "rope.scaling.type") == "linear":
        return {"type": "linear", "factor": float(meta[p + "rope.scaling.factor"])}
    return None


def model_module(arch: str):
    from mlx_lm.models import gemma3_text, llama, qwen2, qwen3

    return {"llama": llama, "qwen2": qwen2, "qwen3": qwen3, "gemma3": gemma3_text}[arch]


def model_args(header: GGUFHeader, spec: ModelSpec, *, rope_traditional: bool = True) -> Any:
    """mlx_lm ``ModelArgs`` of a checked header (``rope_traditional``: llama only; the argument
    exists so a test can load a llama file the wrong way on purpose)."""
    meta, p, s = header.metadata, spec.arch + ".", spec
    common = dict(
        hidden_size=s.hidden, num_hidden_layers=s.layers, intermediate_size=s.ffn,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, vocab_size=s.vocab,
        max_position_embeddings=int(meta.get(p + "context_length", 4096)),
        rope_scaling=_rope_scaling(meta, p),
    )  # fmt: skip
    eps_default = 1e-6 if s.arch == "gemma3" else 1e-5
    eps = f32_round(meta.get(p + "attention.layer_norm_rms_epsilon", eps_default))
    theta = float(meta.get(p + "rope.freq_base", 1e6 if s.arch != "llama" else 1e4))
    mod = model_module(s.arch)
    if s.arch == "gemma3":
        return mod.ModelArgs(
            model_type="gemma3_text", head_dim=s.head_dim, rms_norm_eps=eps, rope_theta=theta,
            rope_local_base_freq=GEMMA3_LOCAL_ROPE_BASE, query_pre_attn_scalar=s.head_dim,
            sliding_window=int(meta.get(p + "attention.sliding_window", 4096)),
            sliding_window_pattern=GEMMA3_SLIDING_PATTERN, **common,
        )  # fmt: skip
    if s.arch == "llama":
        return mod.ModelArgs(
            model_type="llama", head_dim=s.head_dim, rms_norm_eps=eps, rope_theta=theta,
            rope_traditional=rope_traditional, tie_word_embeddings=s.tied, **common,
        )  # fmt: skip
    if s.arch == "qwen3":
        return mod.ModelArgs(
            model_type="qwen3", head_dim=s.head_dim, rms_norm_eps=eps, rope_theta=theta,
            tie_word_embeddings=s.tied, **common,
        )  # fmt: skip
    return mod.ModelArgs(
        model_type="qwen2", rms_norm_eps=eps, rope_theta=theta, tie_word_embeddings=s.tied,
        **common,
    )  # fmt: skip


def build_model(header: GGUFHeader, spec: ModelSpec, *, rope_traditional: bool = True):
    """An uninitialised mlx_lm model of the file's family."""
    args = model_args(header, spec, rope_traditional=rope_traditional)
    return model_module(spec.arch).Model(args)
