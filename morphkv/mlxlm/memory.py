"""A memory size resolved for one model: the shapes of its morphkv layers, read off one step.

``layer_shapes`` runs the model once on one token with its own caches and reads each
full-attention layer's keys and values (KV heads, head dims, dtype), so the shapes are the
model's real ones (sharded, grouped-query, float16 or float32 alike); ``resolve_for_model``
turns a ``kv_memory`` config into a budget with ``morphkv.core.memory.resolve``. Results are
remembered per model and config, so ``patch_model``'s ``make_cache`` resolves once.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
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


def _probed(model: Any, factory=None) -> list:
    """The model's own caches after a one-token forward pass (the shapes are then known)."""
    caches = native_caches(model, factory)
    model(mx.array([[0]]), cache=caches)
    return caches


def layer_shapes(model: Any, factory=None, caches: list | None = None) -> list[LayerShape]:
    """One ``LayerShape`` per full-attention layer (the layers morphkv bounds), measured by a
    one-token forward pass through the model's own caches."""
    caches = _probed(model, factory) if caches is None else caches
    ratio = _query_ratio(model)
    shapes = []
    for cache in _global_caches(caches):
        keys, values = cache.keys, cache.values
        H = keys.shape[1]
        shapes.append(LayerShape(H, keys.shape[3], values.shape[3], keys.dtype, H * ratio))
    return shapes


@dataclass(frozen=True)
class OtherLayers:
    """Layers morphkv does not replace whose caches stop growing by themselves: sliding-window
    layers (mlx_lm's ``RotatingKVCache``: ``window`` slots of ``per_token`` bytes each, K+V
    over the layer's KV heads, once the window is full) or fixed-size state (``window`` 0,
    ``per_token`` the state's bytes)."""

    layers: tuple[int, ...]
    window: int
    per_token: int

    def nbytes(self, cut_to: int | None = None) -> int:
        """Bytes of these layers at their cap, or cut to ``cut_to`` tokens (``--bound-sliding``)."""
        if not self.window:
            return len(self.layers) * self.per_token
        slots = self.window if cut_to is None else min(self.window, cut_to)
        return len(self.layers) * slots * self.per_token


def other_layers(model: Any, factory=None, caches: list | None = None) -> list[OtherLayers]:
    """The layers of ``model`` that keep mlx_lm's caches and are bounded on their own, grouped
    by (window, bytes per token); unbounded ones (none in the models morphkv supports) are
    left out."""
    from mlx_lm.models.cache import RotatingKVCache

    caches = _probed(model, factory) if caches is None else caches
    groups: dict[tuple[int, int], list[int]] = {}
    for i, cache in enumerate(caches):
        inner = cache.caches if isinstance(cache, CacheList) else (cache,)
        for c in inner:
            if _is_global(c):
                continue
            if isinstance(c, RotatingKVCache) and c.keys is not None:
                per = c.keys.shape[1] * (c.keys.shape[3] * c.keys.itemsize
                                         + c.values.shape[3] * c.values.itemsize)
                groups.setdefault((c.max_size, per), []).append(i)
            elif not isinstance(c, RotatingKVCache) and hasattr(c, "nbytes"):
                groups.setdefault((0, c.nbytes), []).append(i)
    return [OtherLayers(tuple(v), w, p) for (w, p), v in groups.items()]


def bounds_sliding(model: Any) -> bool:
    """True when the sliding-window layers of ``model`` are cut to the budget too
    (``morphkv serve --bound-sliding`` sets ``model.morphkv_bound_sliding``)."""
    return bool(getattr(model, "morphkv_bound_sliding", False))


def resolve_for_model(model: Any, config: KVCacheConfig, factory=None) -> KVCacheConfig:
    """``config`` with its ``kv_memory`` resolved into a budget for ``model`` (returned as is
    when there is nothing to resolve). The bytes of the layers morphkv does not replace
    (Gemma 3's sliding-window layers at their window, or cut to the budget with
    ``bounds_sliding``) count against ``kv_memory`` too: it bounds every layer."""
    if not needs_resolving(config):
        return config
    key = id(model)
    entry = _RESOLVED.get(key)
    if entry is None or entry[0]() is not model:
        entry = (weakref.ref(model, lambda _, k=key: _RESOLVED.pop(k, None)), {})
        _RESOLVED[key] = entry
    cut = bounds_sliding(model)
    if (config, cut) not in entry[1]:
        caches = _probed(model, factory)
        others = other_layers(model, caches=caches)

        def fixed(budget: int) -> int:
            return sum(o.nbytes(budget if cut else None) for o in others)

        entry[1][(config, cut)] = resolve(config, layer_shapes(model, caches=caches), fixed)
    return entry[1][(config, cut)]
