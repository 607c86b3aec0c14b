"""The rule protocol: a dataclass holding its own knobs, saying what it reads, and ``score()``."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ..knobs import FIELDS

Array = Any  # numpy.ndarray or mlx.core.array


@dataclasses.dataclass(frozen=True)
class Rule:
    """Base rule. A rule's dataclass fields are its knobs, named as the knobs are
    (``morphkv.core.knobs``: ``fusion``, ``peak``, ``decay``, ``seed``), validated in
    ``__post_init__``; ``from_config`` reads them from a ``KVCacheConfig``. It declares what
    the engine keeps for it:

    - ``attention``: attention rows at all (real queries or keys as proxies);
    - ``window_rows``: ``"all"`` (the last ``window`` tokens' rows), ``"newest"`` (the newest
      token's row) or None;
    - ``running``: a running score per slot, ``"sum"`` (h2o) or ``"peak"`` (a running max,
      decaying by ``decay`` per token), or None;
    - ``evicts``: False for the no-eviction reference; ``sinks``: False when the first tokens
      are not protected;
    - ``scheduled``: how a rule that reads no attention ranks (``"recency"`` by position,
      ``"keydiff"`` by key geometry): the MLX engine then decides a chunk's evictions before
      its queries attend (``morphkv.core.device_schedule``); None for every other rule.

    Value norms (``morphkv_value``) and span pooling (``morphkv_pool``) apply to the scores of
    ``attention`` rules; stored keys are read through ``engine.slot_keys()`` at an eviction."""

    attention: ClassVar[bool] = False
    evicts: ClassVar[bool] = True
    sinks: ClassVar[bool] = True
    window_rows: ClassVar[str | None] = None
    running: ClassVar[str | None] = None
    decay: ClassVar[float] = 1.0
    scheduled: ClassVar[str | None] = None

    @property
    def observes(self) -> bool:
        """Keeps a running score per slot (updated by the engine)."""
        return self.running is not None

    @classmethod
    def knobs(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_config(cls, config) -> Rule:
        return cls(**{name: getattr(config, FIELDS[name]) for name in cls.knobs()})

    def score(self, engine) -> Array:
        """(rows, slots) scores >= 0 of the stored slots; the lowest unprotected go."""
        raise NotImplementedError


def real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check(ok: bool, knob: str, text: str) -> None:
    """``ValueError`` ``"<config field> <text>"`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{FIELDS[knob]} {text}")
