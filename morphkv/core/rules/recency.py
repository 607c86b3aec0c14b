"""Rules that read no attention: the reference, recency and a seeded random draw."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Array, Rule, check


@dataclass(frozen=True)
class Full(Rule):
    """No eviction: the reference every other rule is measured against."""

    evicts = False


@dataclass(frozen=True)
class Recency(Rule):
    """Evict the oldest unprotected token (``streaming_llm``)."""

    scheduled = "recency"

    def score(self, engine) -> Array:
        return engine.stored_positions.astype(engine.float)


@dataclass(frozen=True)
class SlidingWindow(Recency):
    """Recency with no sinks: the last ``budget`` tokens (``sliding_window``)."""

    sinks = False


@dataclass(frozen=True)
class Random(Rule):
    """Evict a uniformly random unprotected token; the draw hashes (seed, row, step, position)
    with 32-bit integer mixing (murmur3's finalizer), so any chunking of a stream and either
    array module make the same choices."""

    seed: int = 0

    def __post_init__(self) -> None:
        check(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed",
              f"must be an int, got {self.seed!r}")

    def score(self, engine) -> Array:
        xp, u32 = engine.xp, engine.xp.uint32

        def const(value: int) -> Array:
            return xp.array(value % 2**32, dtype=u32)

        rows = getattr(engine, "row_ids", None)  # a batch's rows: each its own KV heads
        rows = xp.arange(engine.rows).astype(u32)[:, None] if rows is None else rows
        x = engine.stored_positions.astype(u32) * const(0x9E3779B1)
        x = x ^ (rows * const(0x85EBCA77)) ^ const(engine.seen * 0xC2B2AE3D + self.seed)
        x = (x ^ (x >> const(16))) * const(0x85EBCA6B)
        x = (x ^ (x >> const(13))) * const(0xC2B2AE35)
        return (x ^ (x >> const(16))).astype(engine.float)
