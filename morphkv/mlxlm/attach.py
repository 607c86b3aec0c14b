"""Route a model's attention through its morphkv caches: real-query scoring and exact chunks.

With the hook (``morphkv.mlxlm.hooks``) attached, a ``MorphKVCache``

* gets the model's real queries and the scale the model passes (``scoring="attention"``), and
* for a multi-token chunk replaces the one causal mask that mlx_lm shares across layers with
  this layer's liveness mask: query i sees exactly the tokens that would be stored had the
  chunk been fed one token at a time (every token kept before the chunk that was not evicted
  before step i, and the chunk's tokens up to i).

Any other cache, or none, falls through to the original function unchanged. ``attach`` and
``detach`` are per model: detaching one model leaves every other attached model hooked.
"""

from __future__ import annotations

from typing import Any

from ..core.config import KVCacheConfig
from . import hooks
from .builder import patch_model

HOOK_NAME = hooks.HOOK_NAME


def attachable(model: Any) -> bool:
    """Whether ``attach`` supports this model (some module of it calls mlx_lm's
    ``scaled_dot_product_attention`` by name)."""
    return bool(hooks.hook_modules(model))


def attach(model: Any, config: KVCacheConfig | None = None) -> Any:
    """Route ``model``'s attention through morphkv caches; with a config, also install the
    cache factory (``patch_model``). Idempotent; ``detach`` undoes it for this model only.
    Raises ``ValueError`` naming the model's module when the hook cannot reach it."""
    if config is not None:
        config.validate()
    hooks.install(model)
    if config is not None:
        patch_model(model, config)
    return model


def detach(model: Any) -> Any:
    """Stop routing ``model``'s attention through morphkv (a no-op when it is not attached).
    A model module gets its original function back once no attached model uses it."""
    hooks.uninstall(model)
    return model
