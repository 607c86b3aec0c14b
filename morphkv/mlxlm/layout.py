"""Which layer of a model gets which cache: the model's own layout, global layers bounded.

mlx_lm models that mix layer kinds build their own cache list (``model.make_cache()``):
``RotatingKVCache`` on sliding-window layers (Gemma 3, gpt-oss), ``ArraysCache`` / ``MambaCache``
on linear-attention and state-space layers (Qwen3-Next, ...), ``CacheList`` where a layer has
several, plain ``KVCache`` on full-attention ("global") layers. morphkv replaces only the plain
``KVCache`` entries (also inside a ``CacheList``); everything else is kept as mlx_lm made it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, RotatingKVCache


def native_factory(model: Any) -> Callable[[], list] | None:
    """The model's own cache factory, never one ``patch_model`` installed (that one keeps the
    factory it replaced as ``morphkv_native``): calling it cannot recurse into morphkv."""
    installed = vars(model).get("make_cache") if hasattr(model, "__dict__") else None
    if installed is not None:
        if hasattr(installed, "morphkv_native"):
            return installed.morphkv_native
        return installed
    method = getattr(type(model), "make_cache", None)
    return None if method is None else method.__get__(model)


def native_caches(model: Any, factory: Callable[[], list] | None = None) -> list:
    """A fresh cache list as mlx_lm would build it for ``model`` (``make_prompt_cache``
    without ``max_kv_size``)."""
    factory = native_factory(model) if factory is None else factory
    if factory is not None:
        return list(factory())
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .layers; cannot build one cache per layer")
    return [KVCache() for _ in layers]


def _is_global(cache: Any) -> bool:
    return type(cache) is KVCache  # not Rotating, Quantized, Chunked, Batch...


def count_global(caches: list) -> int:
    """Plain ``KVCache`` entries (full attention), ``CacheList`` entries looked into."""
    return sum(
        count_global(list(c.caches)) if isinstance(c, CacheList) else _is_global(c) for c in caches
    )


def replace_global(caches: list, make: Callable[[], Any]) -> list:
    """``caches`` with each plain ``KVCache`` (full attention) replaced by ``make()``, in
    place inside ``CacheList`` entries."""

    def swap(cache):
        if _is_global(cache):
            return make()
        if isinstance(cache, CacheList):
            cache.caches = tuple(swap(c) for c in cache.caches)
        return cache

    return [swap(c) for c in caches]


def cut_sliding(caches: list, tokens: int) -> list:
    """``caches`` with each sliding-window ``RotatingKVCache`` longer than ``tokens`` replaced by
    ``RotatingKVCache(tokens)`` (its newest ``tokens`` tokens; no kept first tokens, which
    mlx_lm's batch cache does not carry), in place inside ``CacheList`` entries."""

    def swap(cache):
        if type(cache) is RotatingKVCache and cache.max_size > tokens:
            return RotatingKVCache(max_size=tokens)
        if isinstance(cache, CacheList):
            cache.caches = tuple(swap(c) for c in cache.caches)
        return cache

    return [swap(c) for c in caches]


def install_cut_sliding(model: Any, tokens: int) -> None:
    """Make ``model.make_cache`` (patched by ``patch_model``) cut the sliding-window layers to
    ``tokens`` too; ``native_factory`` still finds the model's own factory."""
    inner = model.make_cache

    def make_cache():
        return cut_sliding(list(inner()), tokens)

    make_cache.morphkv_native = getattr(inner, "morphkv_native", None)
    model.morphkv_bound_sliding = True
    model.make_cache = make_cache


@dataclass(frozen=True)
class LayerBound:
    """What bounds one layer's cache."""

    layer: int
    kind: str  # cache class name (CacheList: "CacheList(A, B)")
    bound: str  # e.g. "morphkv budget 512", "window 512", "fixed-size state", "none"


def _bound(cache: Any) -> str:
    config = getattr(cache, "config", None)
    if config is not None and hasattr(config, "budget"):
        if not config.rule.evicts:
            return f"none (method {config.method})"
        return f"{config.method} budget {config.budget}"
    if isinstance(cache, RotatingKVCache):
        return f"window {cache.max_size}"
    if isinstance(cache, CacheList):
        return " + ".join(_bound(c) for c in cache.caches)
    if hasattr(cache, "chunk_size"):
        return f"attention chunk {cache.chunk_size}"
    if isinstance(cache, (KVCache, QuantizedKVCache)):
        return "none (grows with the sequence)"
    return "fixed-size state"


def _kind(cache: Any) -> str:
    if isinstance(cache, CacheList):
        return f"CacheList({', '.join(_kind(c) for c in cache.caches)})"
    return type(cache).__name__


def layer_bounds(caches: list) -> list[LayerBound]:
    """One record per layer: its cache class and what bounds it."""
    return [LayerBound(i, _kind(c), _bound(c)) for i, c in enumerate(caches)]


def _ranges(layers: list[int]) -> str:
    parts, start = [], None
    for i, n in enumerate(layers):
        start = n if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            parts.append(str(n) if start == n else f"{start}-{n}")
            start = None
    return ",".join(parts)


def describe_layout(caches: list) -> str:
    """One line per (cache kind, bound), e.g.
    ``4 x MorphKVCache, morphkv budget 512 (layers 5,11,17,23)``."""
    groups: dict[tuple[str, str], list[int]] = {}
    for record in layer_bounds(caches):
        groups.setdefault((record.kind, record.bound), []).append(record.layer)
    return "\n".join(
        f"{len(layers)} x {kind}, {bound} (layers {_ranges(layers)})"
        for (kind, bound), layers in groups.items()
    )


def morph_caches(caches: list) -> list:
    """The morphkv caches of a layout, in layer order (``CacheList`` entries looked into):
    the ones whose ``tokens_kept`` / ``morphkv_kept_bytes`` stats mean something."""
    found = []
    for cache in caches:
        inner = cache.caches if isinstance(cache, CacheList) else (cache,)
        found.extend(c for c in inner if hasattr(c, "prepare_attention"))
    return found
