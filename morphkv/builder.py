"""Building caches for a model, and making mlx_lm build them on every generation."""

from __future__ import annotations

import dataclasses
from typing import Any

from .cache import MorphKVCache
from .config import KVCacheConfig


def _model_head_dim(model: Any) -> int | None:
    args = getattr(model, "args", None)
    if args is None:
        return None
    head_dim = getattr(args, "head_dim", None)
    if head_dim:
        return int(head_dim)
    hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    return hidden // heads if hidden and heads else None


def _layers(model: Any) -> list:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .layers; cannot build one cache per layer")
    return list(layers)


class KVCacheBuilder:
    """Factory of ``MorphKVCache`` objects."""

    @staticmethod
    def build(config: KVCacheConfig) -> MorphKVCache:
        """One layer's cache (config is validated here)."""
        return MorphKVCache(config)

    @staticmethod
    def for_model(model: Any, config: KVCacheConfig) -> list[MorphKVCache]:
        """One fresh cache per attention layer of an mlx_lm model, ``head_dim`` inferred from
        the model when the config leaves it ``None``. For the supported model families the
        attention hook is attached (``morphkv.attach``), so prefill chunks are exact and
        ``scoring="auto"`` means the model's real queries."""
        from .attach import attach, attachable  # attach builds on this module

        config = config.validate()
        if config.head_dim is None:
            config = dataclasses.replace(config, head_dim=_model_head_dim(model))
        for layer in _layers(model):
            if getattr(layer, "use_sliding", False):
                raise ValueError(
                    "this model has sliding-window attention layers, which MorphKVCache "
                    "does not support"
                )
        if attachable(model):  # exact chunks, and real queries for scoring="auto"
            attach(model)
            if config.scoring == "auto":
                config = dataclasses.replace(config, scoring="attention")
        elif config.scoring == "attention":
            attach(model)  # raises, naming the unsupported module
        return [MorphKVCache(config) for _ in _layers(model)]


def patch_model(model: Any, config: KVCacheConfig) -> Any:
    """Install ``model.make_cache`` so mlx_lm's ``generate``, ``stream_generate``,
    ``make_prompt_cache`` (and the server) build fresh MorphKV caches on every call.
    Returns the model; ``unpatch_model`` restores the original factory."""
    config.validate()
    model.make_cache = lambda: KVCacheBuilder.for_model(model, config)
    return model


def unpatch_model(model: Any) -> Any:
    """Undo ``patch_model``."""
    if "make_cache" in vars(model):
        del model.make_cache
    return model
