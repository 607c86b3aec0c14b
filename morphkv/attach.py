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

import mlx.core as mx
import numpy as np

from .builder import patch_model
from .cache import MorphKVCache, _Chunk
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
        if isinstance(cache, MorphKVCache) and cache._chunk is not None:
            mask = _exact_mask(cache, queries, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.morphkv_original = original
    return scaled_dot_product_attention


def _exact_mask(cache: MorphKVCache, queries: mx.array, mask):
    """Hand the cache this layer's queries (attention scoring); return the mask for the
    chunk: mlx_lm's own for one token (the engine runs later, see ``MorphKVCache._flush``),
    the liveness mask for several (which needs the engine's decisions now)."""
    B, n_heads, C, _ = queries.shape
    H = cache.keys.shape[1]
    if cache.config.scoring == "attention" and not cache._chunk.fed:
        cache._chunk.queries = queries
    if C == 1:
        return mask
    visible = mx.array(_liveness(cache._flush(), C))  # (B*H, C, rows)
    rows = visible.shape[-1]
    visible = mx.broadcast_to(visible.reshape(B, H, 1, C, rows), (B, H, n_heads // H, C, rows))
    return visible.reshape(B, n_heads, C, rows)


def _liveness(chunk: _Chunk, C: int) -> np.ndarray:
    """(rows, C, fetched rows) bool: may query i of the chunk see fetched row j?"""
    R, before = chunk.old_positions.shape
    first = chunk.first
    old = chunk.old_positions.copy()
    had_dead = chunk.dead is not None
    if had_dead:
        old[np.arange(R), chunk.dead] = first  # the first new token took the dead slot
    appended = np.arange(first + had_dead, first + C)
    positions = np.concatenate([old, np.broadcast_to(appended, (R, appended.size))], axis=1)
    # step at which each fetched row's token was evicted (C: not evicted in this chunk)
    order = np.argsort(positions, axis=1)
    sorted_positions = np.take_along_axis(positions, order, axis=1)
    evicted_at = np.full(positions.shape, C, np.int64)
    step_rows, steps = np.nonzero(chunk.evicted >= 0)
    stride = first + C + 1  # offsetting each row by this keeps the flattened rows sorted
    offsets = np.arange(R)[:, None] * stride
    found = np.searchsorted(
        (sorted_positions + offsets).ravel(), chunk.evicted[step_rows, steps] + step_rows * stride
    )
    evicted_at[step_rows, order[step_rows, found - step_rows * positions.shape[1]]] = steps
    query_positions = first + np.arange(C)[None, :, None]
    return (positions[:, None, :] <= query_positions) & (
        evicted_at[:, None, :] >= np.arange(C)[None, :, None]
    )
