"""Model loading: the embedded SmolLM2-135M-Instruct GGUF, any Llama GGUF, or mlx_lm models."""

from __future__ import annotations

from pathlib import Path

from .gguf_header import GGUFError
from .resolve import DEFAULT_MODEL_NAME, ModelUnavailableError, resolve_default_gguf

# What a command line should catch around ``load``: one line, exit 2, no traceback.
MODEL_ERRORS = (GGUFError, ModelUnavailableError, FileNotFoundError)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "GGUFError",
    "MODEL_ERRORS",
    "ModelUnavailableError",
    "load",
    "load_gguf_model",
    "resolve_default_gguf",
]


def load_gguf_model(path: str | Path, *, rope_traditional: bool = True):
    """(model, TokenizerWrapper) from a Llama-family GGUF file."""
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
    - a path ending in ``.gguf``: the GGUF loader (Llama family);
    - anything else: ``mlx_lm.load(model)`` (local MLX directory or Hugging Face repo).
    """
    if model is None:
        return load_gguf_model(resolve_default_gguf(), rope_traditional=rope_traditional)
    if str(model).lower().endswith(".gguf"):
        if not Path(model).is_file():
            raise FileNotFoundError(f"GGUF file not found: {model}")
        return load_gguf_model(model, rope_traditional=rope_traditional)
    import mlx_lm

    return mlx_lm.load(model)[:2]
