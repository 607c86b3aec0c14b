"""Eviction rules: each one is a small scoring function over the stored slots.

A rule sees the selection engine (``morphkv.core.engine.Engine``) after the newest token was
appended and returns one score per stored slot, shape (rows, slots), where rows are the
flattened (batch, KV head) pairs. The engine evicts the lowest-scoring unprotected slot
(the first ``n_sink`` positions and the last ``window`` positions are protected), ties to the
oldest. Scores are >= 0. Rules use the engine's array module ``engine.xp``: NumPy (float64) on
the host, or ``mlx.core`` (float32) when decoding on a GPU without host syncs.
"""

from __future__ import annotations

from typing import Any

Array = Any  # numpy.ndarray or mlx.core.array


class Rule:
    """Base rule. ``attention`` says whether the engine must keep attention logits."""

    attention = False  # needs the ring of window logits
    evicts = True
    observes = False  # needs observe() after every token

    def observe(self, engine) -> None:
        """Called after every appended token (also before the budget is reached)."""

    def score(self, engine) -> Array:
        raise NotImplementedError


class Full(Rule):
    """No eviction: the reference every other rule is measured against."""

    evicts = False


class Recency(Rule):
    """Evict the oldest unprotected token (``sliding_window``, ``streaming_llm``)."""

    def score(self, engine) -> Array:
        return engine.stored_positions.astype(engine.float)


class Random(Rule):
    """Evict a uniformly random unprotected token; the draw hashes (seed, row, step, position)
    with 32-bit integer mixing (murmur3's finalizer), so any chunking of a stream and either
    array module make the same choices."""

    def __init__(self, seed: int) -> None:
        self.seed = seed % 2**32

    def score(self, engine) -> Array:
        xp, u32 = engine.xp, engine.xp.uint32

        def const(value: int) -> Array:
            return xp.array(value % 2**32, dtype=u32)

        rows = xp.arange(engine.rows).astype(u32)[:, None]
        x = engine.stored_positions.astype(u32) * const(0x9E3779B1)
        x = x ^ (rows * const(0x85EBCA77)) ^ const(engine.seen * 0xC2B2AE3D + self.seed)
        x = (x ^ (x >> const(16))) * const(0x85EBCA6B)
        x = (x ^ (x >> const(13))) * const(0xC2B2AE35)
        return (x ^ (x >> const(16))).astype(engine.float)


class WindowAttention(Rule):
    """MorphKV: attention of the last ``window`` tokens' queries (``morphkv.core.rows``), fused by
    mean or max over the window. ``newest_only`` gives TOVA."""

    attention = True

    def __init__(self, fusion: str = "mean", newest_only: bool = False) -> None:
        self.fusion = fusion
        self.newest_only = newest_only

    def score(self, engine) -> Array:
        if self.newest_only:
            return engine.newest_probs().astype(engine.float)
        if self.fusion == "max":  # rows (rows, window, slots), GQA: summed over the group
            return engine.window_probs().max(axis=1).astype(engine.float)
        return engine.window_mean()


class Cumulative(Rule):
    """H2O: every new token's attention row is added to a running score per stored token."""

    attention = True
    observes = True

    def observe(self, engine) -> None:
        newest = engine.newest_probs().astype(engine.float)
        engine.accumulated[:, : engine.slots] = engine.accumulated[:, : engine.slots] + newest

    def score(self, engine) -> Array:
        return engine.accumulated[:, : engine.slots]


def make_rule(config) -> Rule:
    """The rule object for ``config.method``."""
    return METHODS[config.method](config)


METHODS = {
    "full": lambda c: Full(),
    "sliding_window": lambda c: Recency(),
    "streaming_llm": lambda c: Recency(),
    "h2o": lambda c: Cumulative(),
    "tova": lambda c: WindowAttention(newest_only=True),
    "morphkv": lambda c: WindowAttention(fusion=c.morphkv_fusion),
    "random": lambda c: Random(c.seed),
}
