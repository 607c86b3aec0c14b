"""Route a model's attention through its morphkv caches: real-query scoring and exact chunks.

mlx_lm hands queries to the cache nowhere: each model module calls
``scaled_dot_product_attention(queries, keys, values, cache=..., scale=..., mask=...)``, a name
it imported from ``mlx_lm.models.base``. ``attach`` rebinds that name in the model's own module
(patching ``base`` alone would change nothing). With a ``MorphKVCache`` the hook

* feeds the cache's selection engine the real queries (``scoring="attention"``), and
* for a multi-token chunk replaces the one causal mask that mlx_lm shares across layers with
  this layer's liveness mask: query i sees exactly the tokens that would be stored had the
  chunk been fed one token at a time (every token kept before the chunk that was not evicted
  before step i, and the chunk's tokens up to i).

Any other cache, or none, falls through to the original function unchanged.
"""

from __future__ import annotations

import sys
from typing import Any

from .builder import patch_model
from .config import KVCacheConfig
from .hooks import _ATTACHED

HOOK_NAME = "scaled_dot_product_attention"


def attachable(model: Any) -> bool:
    """Whether ``attach`` supports this model's module."""
    module = sys.modules.get(type(model).__module__)
    return module is not None and callable(getattr(module, HOOK_NAME, None))


def _model_module(model: Any):
    if not attachable(model):
        raise ValueError(
            f"cannot attach to {type(model).__module__}: the module does not call "
            f"{HOOK_NAME} by name (supported: mlx_lm's llama, mistral, qwen2, qwen3 families)"
        )
    return sys.modules[type(model).__module__]


def attach(model: Any, config: KVCacheConfig | None = None) -> Any:
    """Route ``model``'s attention through morphkv caches; with a config, also install the
    cache factory (``patch_model``). Idempotent; ``detach`` undoes it."""
    module = _model_module(model)
    if module.__name__ not in _ATTACHED:
        original = getattr(module, HOOK_NAME)
        _ATTACHED[module.__name__] = original
        setattr(module, HOOK_NAME, _make_hook(original))
    if config is not None:
        patch_model(model, config)
    return model


def detach(model: Any) -> Any:
    """Restore the model module's original attention function."""
    module = _model_module(model)
    original = _ATTACHED.pop(module.__name__, None)
    if original is not None:
        setattr(module, HOOK_NAME, original)
    return model


def _make_hook(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        prepare = getattr(cache, "prepare_attention", None)
        if prepare is not None:  # a morphkv cache: it takes the queries, may change the mask
            mask = prepare(queries, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.morphkv_original = original
    return scaled_dot_product_attention
