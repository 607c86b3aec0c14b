"""The attention hook: which mlx_lm model modules route attention through morphkv caches.

mlx_lm hands queries to the cache nowhere: each model module calls
``scaled_dot_product_attention(queries, keys, values, cache=..., scale=..., mask=...)``, a name
it imported from ``mlx_lm.models.base``. ``install`` rebinds that name in every Python module
that defines a class of the model's tree (a wrapper such as ``gemma3`` reaches its
``gemma3_text`` attention that way; patching ``base`` alone would change nothing). With a cache
that has ``attend`` (``MorphKVCache`` on the MLX path) the cache computes the attention itself
(one softmax for the output and the rule's statistics); on the host path (``prepare_attention``)
the hook hands it this layer's queries and the scale the model uses, and attends with the mask
the cache returns; any other cache, or none, falls through to the original function unchanged.

The rebinding is per Python module, the bookkeeping per model: a module keeps the hook while at
least one model installed on it is alive and not uninstalled (models are held weakly).
"""

from __future__ import annotations

import sys
import weakref
from types import ModuleType
from typing import Any

from mlx_lm.models import base

from ..core.queries import _ATTACHED, hooks_attached, queries_by_hand  # noqa: F401 (API)

HOOK_NAME = "scaled_dot_product_attention"

_MODELS: dict[str, dict[int, weakref.ref]] = {}  # module name -> id(model) -> the model


def _routes_attention(module: ModuleType) -> bool:
    fn = getattr(module, HOOK_NAME, None)
    return fn is base.scaled_dot_product_attention or hasattr(fn, "morphkv_original")


def hook_modules(model: Any) -> list[ModuleType]:
    """The Python modules of ``model``'s layer classes that call mlx_lm's
    ``scaled_dot_product_attention`` by name (empty: the hook cannot reach this model)."""
    tree = model.modules() if callable(getattr(model, "modules", None)) else [model]
    names = sorted({type(m).__module__ for m in tree} | {type(model).__module__})
    modules = (sys.modules.get(name) for name in names)
    return [m for m in modules if m is not None and _routes_attention(m)]


def is_installed(model: Any) -> bool:
    """Whether ``install(model)`` is in effect."""
    return any(id(model) in models for models in _MODELS.values())


def install(model: Any) -> list[str]:
    """Hook every module of ``model`` that routes attention (idempotent). Returns their names;
    raises ``ValueError`` naming the model's module when there is none."""
    modules = hook_modules(model)
    if not modules:
        raise ValueError(
            f"cannot attach to {type(model).__module__}: none of its modules call "
            f"{HOOK_NAME} by name (mlx_lm's llama, mistral, qwen2, qwen3, phi3, gemma, gemma3, "
            "starcoder2, olmo2, cohere, gpt_oss, qwen3_next ... do; gemma2 does not)"
        )
    key = id(model)
    for module in modules:
        name = module.__name__
        if name not in _ATTACHED:
            original = getattr(module, HOOK_NAME)
            _ATTACHED[name] = original
            setattr(module, HOOK_NAME, _make_hook(original))
        models = _MODELS.setdefault(name, {})
        if key not in models:
            models[key] = weakref.ref(model, lambda _, n=name, k=key: _release(n, k))
    return [m.__name__ for m in modules]


def uninstall(model: Any) -> None:
    """Drop ``model`` from every hooked module; a module no other live model uses gets its
    original function back. Other models stay attached."""
    for name in [n for n, models in _MODELS.items() if id(model) in models]:
        _release(name, id(model))


def _release(name: str, key: int) -> None:
    models = _MODELS.get(name, {})
    models.pop(key, None)
    if any(ref() is not None for ref in models.values()):
        return
    _MODELS.pop(name, None)
    original = _ATTACHED.pop(name, None)
    module = sys.modules.get(name)
    if original is not None and module is not None:
        setattr(module, HOOK_NAME, original)


def attend(original, queries, keys, values, cache, scale, mask, sinks=None):
    """One layer's attention as the hook runs it: a morphkv cache on the MLX path attends
    itself (``attend``: the output and the rule's statistics from one softmax); on the host
    path it takes the queries and may change the mask; anything else is ``original``."""
    own = getattr(cache, "attend", None)
    out = None if own is None else own(queries, scale, mask, sinks)
    if out is not None:
        return out
    prepare = getattr(cache, "prepare_attention", None)
    if prepare is not None:  # a morphkv cache: it takes the queries, may change the mask
        mask = prepare(queries, scale, mask)
    return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def attention_step(cache, queries, keys, values, scale: float, mask=None):
    """One layer's update and attention as a hooked model runs them (benchmarks, tests):
    ``cache.update_and_fetch`` then the hook's attention; any cache (mlx_lm's too)."""
    k, v = cache.update_and_fetch(keys, values)
    if mask is None and queries.shape[2] > 1:
        mask = "causal"
    return attend(base.scaled_dot_product_attention, queries, k, v, cache, scale, mask)


def _make_hook(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        return attend(original, queries, keys, values, cache, scale, mask, sinks)

    scaled_dot_product_attention.morphkv_original = original
    return scaled_dot_product_attention
