"""Shared helpers for tests that need the embedded SmolLM2 model (skip when unobtainable)."""

from __future__ import annotations

import functools
import os

import pytest


@functools.lru_cache(maxsize=1)
def _resolve():
    from morphkv.model.resolve import ModelUnavailableError, resolve_default_gguf

    try:
        return str(resolve_default_gguf()), None
    except ModelUnavailableError as e:
        return None, str(e)


def embedded_gguf_path() -> str:
    """Path of the verified embedded GGUF (fetched once). When it cannot be fetched the test
    is skipped, except under MORPHKV_REQUIRE_MODEL=1 (CI), where that is a failure."""
    path, err = _resolve()
    if path is None:
        if os.environ.get("MORPHKV_REQUIRE_MODEL") == "1":
            pytest.fail(f"embedded model unavailable: {err}")
        pytest.skip(f"embedded model unavailable: {err}")
    return path


@functools.lru_cache(maxsize=2)
def load_embedded(rope_traditional: bool = True):
    """(model, tokenizer) of the embedded model, loaded once per process and layout."""
    from morphkv.model import load_gguf_model

    return load_gguf_model(embedded_gguf_path(), rope_traditional=rope_traditional)
