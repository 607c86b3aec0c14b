"""The model-level step before a forward pass: what no single layer's cache can decide.

A cache sees its own layer only; ``pin_rank="vote"`` (``morphkv.core.vote``) needs every
layer's caches at once, before the first layer takes a prefill chunk. mlx_lm calls the model
itself everywhere (``generate_step``, ``stream_generate``, ``BatchGenerator``, the server):
``watch`` gives the model instance a subclass of its own class whose ``__call__`` runs
``vote.trim`` over the ``cache`` list, then the model's own ``__call__``. Where a vote runs, a
chunk of token ids longer than a quarter of its room is run as pieces of that size (a vote before
each, the logits joined), as mlx_lm's own prefill steps cut a prompt. The class keeps its
name and module (the attention hook finds the same modules), weights and ``isinstance`` are
unchanged, and ``unwatch`` puts the original class back.
"""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx

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
        if not (cache and args and hasattr(args[0], "shape") and args[0].ndim >= 2):
            return cls.__call__(self, *args, **kwargs)
        C = args[0].shape[1]
        size = vote.piece(cache, C) if _tokens_only(args, kwargs, at) else C
        if size == C:
            vote.trim(cache, C)
            return cls.__call__(self, *args, **kwargs)
        outs = []
        for start, end in vote.pieces(C, size):
            vote.trim(cache, end - start, prompt=True)
            _mark(cache, end - start == 1)
            try:
                outs.append(cls.__call__(self, args[0][:, start:end], *args[1:], **kwargs))
            finally:
                _mark(cache, False)
        return mx.concatenate(outs, axis=1)

    return __call__


def _mark(caches: list, on: bool) -> None:
    for c in caches:
        if hasattr(c, "prompt_piece"):
            c.prompt_piece = on


def _tokens_only(args: tuple, kwargs: dict, at: int | None) -> bool:
    """A call of token ids and the cache alone (mlx_lm's every prefill and decode call): one
    that can be cut into column pieces, each run as mlx_lm's own prefill steps run."""
    extra = set(kwargs) - {"cache"}
    return not extra and (len(args) == 1 or (at == 1 and len(args) == 2))
