"""The model-level step before a forward pass: what no single layer's cache can decide.

A cache sees its own layer only; ``pin_rank="vote"`` (``morphkv.core.vote``) needs every
layer's caches at once, before the first layer takes a prefill chunk. mlx_lm calls the model
itself everywhere (``generate_step``, ``stream_generate``, ``BatchGenerator``, the server):
``watch`` gives the model instance a subclass of its own class whose ``__call__`` runs
``vote.trim`` over the ``cache`` list, then the model's own ``__call__``. The class keeps its
name and module (the attention hook finds the same modules), weights and ``isinstance`` are
unchanged, and ``unwatch`` puts the original class back.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..core import vote

_WATCHED: dict[type, type] = {}  # a model class -> its watching subclass


def watch(model: Any) -> Any:
    """Run ``vote.trim`` before each of ``model``'s forward passes (idempotent)."""
    cls = type(model)
    if getattr(cls, "morphkv_watched", None) is None:
        if cls not in _WATCHED:
            _WATCHED[cls] = type(cls.__name__, (cls,), {
                "__call__": _watched_call(cls), "__module__": cls.__module__,
                "__qualname__": cls.__qualname__, "morphkv_watched": cls})
        model.__class__ = _WATCHED[cls]
    return model


def unwatch(model: Any) -> Any:
    original = getattr(type(model), "morphkv_watched", None)
    if original is not None:
        model.__class__ = original
    return model


def _watched_call(cls: type):
    names = list(inspect.signature(cls.__call__).parameters)[1:]  # without self
    at = names.index("cache") if "cache" in names else None

    def __call__(self, *args, **kwargs):
        cache = kwargs.get("cache")
        if cache is None and at is not None and len(args) > at:
            cache = args[at]
        if cache and args and hasattr(args[0], "shape") and args[0].ndim >= 2:
            vote.trim(cache, args[0].shape[1])
        return cls.__call__(self, *args, **kwargs)

    return __call__
