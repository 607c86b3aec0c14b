"""Building caches for a model, and making mlx_lm build them on every generation."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Any

from ..core.cache import MorphKVCache
from ..core.config import VOTES, KVCacheConfig
from . import forward, hooks, keyscale
from .layout import count_global, morph_caches, native_caches, native_factory, replace_global
from .memory import resolve_for_model

_WARNED: dict[int, weakref.ref] = {}  # models already warned about proxy scoring


def _model_head_dim(model: Any) -> int | None:
    args = getattr(model, "args", None)
    if args is None:
        return None
    head_dim = getattr(args, "head_dim", None)
    if head_dim:
        return int(head_dim)
    hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    return hidden // heads if hidden and heads else None


def _warn_once(model: Any, message: str) -> None:
    key = id(model)
    ref = _WARNED.get(key)
    if ref is not None and ref() is model:
        return
    _WARNED[key] = weakref.ref(model, lambda _, k=key: _WARNED.pop(k, None))
    warnings.warn(message, stacklevel=4)


def _scoring(model: Any, config: KVCacheConfig) -> KVCacheConfig:
    """Attach the attention hook where the model's modules allow it; otherwise say (once per
    model) what is lost, or refuse ``scoring="attention"``."""
    if hooks.hook_modules(model):  # exact chunks, and real queries for scoring="auto"
        hooks.install(model)
        if config.scoring == "auto":
            config = dataclasses.replace(config, scoring="attention")
        return config
    if config.scoring == "attention":
        hooks.install(model)  # raises, naming the unsupported module
    _warn_once(
        model,
        f"morphkv: {type(model).__module__} does not route attention through mlx_lm's "
        f"{hooks.HOOK_NAME}, so morphkv cannot see its queries: scoring is 'proxy' (keys stand "
        "in for queries) and a multi-token prefill chunk attends to tokens evicted inside it "
        "(not exact; use prefill_step_size=1 for token-by-token semantics)",
    )
    return config


class KVCacheBuilder:
    """Factory of ``MorphKVCache`` objects."""

    @staticmethod
    def build(config: KVCacheConfig) -> MorphKVCache:
        """One layer's cache (config is validated here)."""
        return MorphKVCache(config)

    @staticmethod
    def for_model(model: Any, config: KVCacheConfig, *, _factory=None) -> list:
        """The model's own cache layout (``model.make_cache()`` where it has one, else one
        ``KVCache`` per layer) with every full-attention ``KVCache`` replaced by a fresh
        ``MorphKVCache``; sliding-window, linear-attention and state-space layers keep
        mlx_lm's caches (``morphkv.mlxlm.layout.describe_layout`` says which layer is bounded by
        what). ``head_dim`` is inferred from the model when the config leaves it ``None``.
        Where the model's modules allow it the attention hook is attached, so prefill chunks
        are exact and ``scoring="auto"`` means the model's real queries; elsewhere a warning
        says scoring is proxy and chunked prefill inexact. A config with ``kv_memory`` and no
        budget (``morphkv.recommended(memory=N)``) gets the most tokens per KV head whose
        caches hold at most ``kv_memory`` bytes over all these layers
        (``morphkv.mlxlm.memory``); ``ValueError`` when even the sinks and recent tokens do
        not fit. A quantizing config smooths the model's keys (``keyscale``, ``kv_smooth``)."""
        config = config.validate(resolved=False)
        if config.head_dim is None:
            config = dataclasses.replace(config, head_dim=_model_head_dim(model))
        caches = native_caches(model, _factory)
        if not count_global(caches):
            kinds = sorted({type(c).__name__ for c in caches})
            raise ValueError(
                f"{type(model).__name__} has no full-attention KVCache layer to bound (its "
                f"caches: {', '.join(kinds) or 'none'}); morphkv has nothing to do here"
            )
        config = _scoring(model, config)
        keyscale.follow(model, config)
        config = resolve_for_model(model, config, _factory)
        if config.pin_rank in VOTES or config.pin_repeats:  # the model's forward pass: one
            forward.watch(model)  # ranking over all layers; the prompt's token ids
        return replace_global(caches, lambda: MorphKVCache(config))

    @staticmethod
    def resolve_with(model: Any, config: KVCacheConfig, factory=None) -> KVCacheConfig:
        """``resolve`` on top of the cache factory ``factory`` (default: the model's own)."""
        caches = KVCacheBuilder.for_model(model, config, _factory=factory)
        return morph_caches(caches)[0].config

    @staticmethod
    def resolve(model: Any, config: KVCacheConfig) -> KVCacheConfig:
        """The config ``for_model`` builds caches with: ``head_dim``, scoring and a
        ``kv_memory`` budget resolved for ``model`` (attaches the hook where it can)."""
        return KVCacheBuilder.resolve_with(model, config)


def patch_model(model: Any, config: KVCacheConfig) -> Any:
    """Install ``model.make_cache`` so mlx_lm's ``generate``, ``stream_generate``,
    ``make_prompt_cache`` (and the server) build fresh caches (``KVCacheBuilder.for_model``)
    on every call. Returns the model; ``unpatch_model`` restores the original factory. A
    ``kv_memory`` config is resolved here, once: a size too small fails now. A quantizing
    config smooths the model's keys here (``keyscale``: ``kv_smooth``, logits unchanged)."""
    config = config.validate(resolved=False)
    keyscale.follow(model, config)
    native = native_factory(model)  # the factory to build on: never our own (no recursion)
    if config.kv_memory is not None:
        config = KVCacheBuilder.resolve_with(model, config, native)

    def make_cache():
        return KVCacheBuilder.for_model(model, config, _factory=native)

    make_cache.morphkv_native = native
    model.make_cache = make_cache
    return model


def unpatch_model(model: Any) -> Any:
    """Undo ``patch_model``: the model's own factory again (one it had on the instance is
    put back) and its own query / key projections (``keyscale.restore``)."""
    forward.unwatch(model)
    keyscale.restore(model)
    installed = vars(model).get("make_cache")
    if installed is not None and hasattr(installed, "morphkv_native"):
        del model.make_cache
        native = installed.morphkv_native
        if native is not None and getattr(native, "__self__", None) is not model:
            model.make_cache = native
    return model
