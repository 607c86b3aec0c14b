"""llama.cpp tensor names per family and their mlx_lm parameter names.

Each family's block has the Llama projections and norms, plus its own: qwen2 biases on Q/K/V,
qwen3 per-head Q/K norms, gemma3 per-head Q/K norms and the norms after attention and after the
MLP (llama.cpp's ``ffn_norm`` is Gemma's *pre*-feed-forward norm).
"""

from __future__ import annotations

import re

from .gguf_header import GGUFError

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")

# block tensor (without "blk.N.") -> dims key for gguf_check (GGUF order, innermost first)
_LLAMA_PARTS = {
    "attn_q.weight": "H,q",
    "attn_k.weight": "H,kv",
    "attn_v.weight": "H,kv",
    "attn_output.weight": "q,H",
    "ffn_gate.weight": "H,ffn",
    "ffn_up.weight": "H,ffn",
    "ffn_down.weight": "ffn,H",
    "attn_norm.weight": "H",
    "ffn_norm.weight": "H",
}
_QK_NORM = {"attn_q_norm.weight": "hd", "attn_k_norm.weight": "hd"}
_PARTS = {
    "llama": _LLAMA_PARTS,
    "qwen2": {**_LLAMA_PARTS, "attn_q.bias": "q", "attn_k.bias": "kv", "attn_v.bias": "kv"},
    "qwen3": {**_LLAMA_PARTS, **_QK_NORM},
    "gemma3": {
        **_LLAMA_PARTS,
        **_QK_NORM,
        "post_attention_norm.weight": "H",
        "post_ffw_norm.weight": "H",
    },  # fmt: skip
}

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA3_MAP = {
    **_LAYER_MAP,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_MAP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


def layer_parts(arch: str) -> dict[str, str]:
    """Block tensor names of ``arch`` (without the ``blk.N.`` prefix) -> dims key."""
    return _PARTS[arch]


def map_tensor_name(name: str, arch: str = "llama") -> str:
    """GGUF tensor name -> mlx_lm parameter name for family ``arch``."""
    table = _GEMMA3_MAP if arch == "gemma3" else _LAYER_MAP
    m = _BLK_RE.match(name)
    if m:
        idx, part, kind = m.groups()
        if part not in table or f"{part}.{'bias' if kind == 'bias' else 'weight'}" not in (
            _PARTS.get(arch, _LLAMA_PARTS)
        ):
            raise GGUFError(f"unsupported GGUF tensor {name} for {arch}")
        return f"model.layers.{int(idx)}.{table[part]}.{kind}"
    m = _TOP_RE.match(name)
    if m and m.group(1) in _TOP_MAP:
        return f"{_TOP_MAP[m.group(1)]}.{m.group(2)}"
    raise GGUFError(f"unsupported GGUF tensor {name}")
