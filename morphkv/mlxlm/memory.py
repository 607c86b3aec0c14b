"""A memory size resolved for one model: the shapes of its morphkv layers, read off one step.

``layer_shapes`` runs the model once on one token with its own caches and reads each
full-attention layer's keys and values (KV heads, head dims, dtype), so the shapes are the
model's real ones (sharded, grouped-query, float16 or float32 alike); ``resolve_for_model``
turns a ``kv_memory`` config into a budget with ``morphkv.core.memory.resolve``. Results are
remembered per model and config, so ``patch_model``'s ``make_cache`` resolves once.
"""

from __future__ import annotations

import weakref
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from ..core.config import KVCacheConfig
from ..core.memory import LayerShape, needs_resolving, resolve
from .layout import _is_global, native_caches

_RESOLVED: dict[int, tuple[weakref.ref, dict]] = {}  # id(model) -> (model, {config: resolved})


def _global_caches(caches: list) -> list:
    found = []
    for cache in caches:
        inner = cache.caches if isinstance(cache, CacheList) else (cache,)
        found.extend(c for c in inner if _is_global(c))
    return found


def _query_ratio(model: Any) -> int:
    """Query heads per KV head from the model's arguments (1 when it does not say)."""
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    return heads // kv_heads if heads and kv_heads and heads % kv_heads == 0 else 1


def layer_shapes(model: Any, factory=None) -> list[LayerShape]:
    """One ``LayerShape`` per full-attention layer (the layers morphkv bounds), measured by a
    one-token forward pass through the model's own caches."""
    caches = native_caches(model, factory)
    model(mx.array([[0]]), cache=caches)
    ratio = _query_ratio(model)
    shapes = []
    for cache in _global_caches(caches):
        keys, values = cache.keys, cache.values
        H = keys.shape[1]
        shapes.append(LayerShape(H, keys.shape[3], values.shape[3], keys.dtype, H * ratio))
    return shapes


def resolve_for_model(model: Any, config: KVCacheConfig, factory=None) -> KVCacheConfig:
    """``config`` with its ``kv_memory`` resolved into a budget for ``model`` (returned as is
    when there is nothing to resolve)."""
    if not needs_resolving(config):
        return config
    key = id(model)
    entry = _RESOLVED.get(key)
    if entry is None or entry[0]() is not model:
        entry = (weakref.ref(model, lambda _, k=key: _RESOLVED.pop(k, None)), {})
        _RESOLVED[key] = entry
    if config not in entry[1]:
        entry[1][config] = resolve(config, layer_shapes(model, factory))
    return entry[1][config]
