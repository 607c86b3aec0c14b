"""The model-level step before a forward pass: what no single layer's cache can decide.

A cache sees its own layer only; ``pin_rank="vote"`` (``morphkv.core.vote``) needs every
layer's caches at once, before the first layer takes a prefill chunk, and ``pin_repeats``
(``morphkv.core.repeats``) needs the prompt's token ids, which no cache sees. mlx_lm calls the
model itself everywhere (``generate_step``, ``stream_generate``, ``BatchGenerator``, the
server): ``watch`` gives the model instance a subclass of its own class whose ``__call__`` runs
``heard`` and ``vote.trim`` over the ``cache`` list, then the model's own ``__call__``. Where a
vote runs, a chunk of token ids longer than a quarter of its room is run as pieces of that size
(a vote before each, the logits joined; ``vote.plan`` joins the leading pieces no vote needs),
as mlx_lm's own prefill steps cut a prompt. The class keeps its name and module (the attention
hook finds the same modules), weights and ``isinstance`` are unchanged, and ``unwatch`` puts the
original class back.
"""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx
import numpy as np

from ..core import repeats, vote

_WATCHED: dict[type, type] = {}  # a model class -> its watching subclass


def watch(model: Any) -> Any:
    """Run ``heard`` and ``vote.trim`` before each of ``model``'s forward passes (idempotent)."""
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
        tokens = _tokens_only(args, kwargs, at)
        skip = heard(cache, args[0], C) if tokens else None
        size = vote.piece(cache, C) if tokens else C
        if size == C and skip is None:  # a decode step; a chunk not cut, nothing to skip
            vote.trim(cache, C)
            return cls.__call__(self, *args, **kwargs)
        outs = []
        for start, end in vote.plan(cache, C, size) if size < C else [(0, C)]:
            _set(cache, "pin_skip", None if skip is None else [m[start:end] for m in skip])
            vote.trim(cache, end - start, prompt=size < C)
            _set(cache, "prompt_piece", size < C and end - start == 1)
            try:
                outs.append(cls.__call__(self, *args, **kwargs) if size == C else
                            cls.__call__(self, args[0][:, start:end], *args[1:], **kwargs))
            finally:
                _set(cache, "prompt_piece", False)
                _set(cache, "pin_skip", None)
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)

    return __call__


def heard(caches: list, ids: mx.array, C: int) -> list | None:
    """``pin_repeats`` (``morphkv.core.repeats``): per row, which of a prompt's ``C`` columns
    repeat a run an earlier prompt of the row held (not pinned); the row remembers this
    prompt's runs. None where nothing is skipped: a one-column step, no cache with the policy,
    or a single cache of several rows (one set of pins for all)."""
    if C < 2 or not mx.issubdtype(ids.dtype, mx.integer):
        return None
    holder = next((c for c in caches if getattr(c, "pin_prompts", False)
                   and c.config.pin_repeats), None)
    if holder is None:
        return None
    starts, counts = holder.spans(C)
    if len(counts) != ids.shape[0]:
        return None
    tokens, n, out = np.array(ids), holder.config.pin_repeats, []  # one read a prompt
    for i, (s, k) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True)):
        pins, mask = holder.pins_of(i), np.zeros(C, np.bool_)
        mask[s : s + k], runs = repeats.repeated(tokens[i, s : s + k], pins.heard, n)
        pins.heard = repeats.remember(pins.heard, runs)
        out.append(mask)
    return out


def _set(caches: list, name: str, value) -> None:
    for c in caches:
        if hasattr(c, "prompt_piece"):  # a morphkv cache (core.feed.Feed)
            setattr(c, name, value)


def _tokens_only(args: tuple, kwargs: dict, at: int | None) -> bool:
    """A call of token ids and the cache alone (mlx_lm's every prefill and decode call): one
    that can be cut into column pieces, each run as mlx_lm's own prefill steps run."""
    extra = set(kwargs) - {"cache"}
    return not extra and (len(args) == 1 or (at == 1 and len(args) == 2))
