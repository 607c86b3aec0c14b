"""Span pooling (SnapKV-style) around another rule."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Array, Rule, check


@dataclass(frozen=True)
class Pooled(Rule):
    """Each unprotected slot's score becomes the largest score of ``inner`` among the
    ``kernel`` stored tokens centred on it in position order (protected tokens count as 0), so
    the neighbouring sub-word tokens of a fact rise and fall together. Scores stay >= 0;
    eviction still picks one slot per step. Reads what ``inner`` reads."""

    inner: Rule
    kernel: int = 1

    def __post_init__(self) -> None:
        k = self.kernel
        check(isinstance(k, int) and not isinstance(k, bool) and k >= 1 and k % 2 == 1, "pool",
              f"must be an odd int >= 1, got {k!r}")

    attention = property(lambda self: self.inner.attention)
    evicts = property(lambda self: self.inner.evicts)
    sinks = property(lambda self: self.inner.sinks)
    window_rows = property(lambda self: self.inner.window_rows)
    running = property(lambda self: self.inner.running)
    decay = property(lambda self: self.inner.decay)

    def score(self, engine) -> Array:
        xp, c = engine.xp, engine.config
        scores = self.inner.score(engine)
        positions = engine.stored_positions
        protected = (positions < c.n_sink) | (positions > engine.seen - 1 - c.recent)
        scores = xp.where(protected, 0.0, scores).astype(engine.float)
        order = xp.argsort(positions, axis=1)
        ranked = xp.take_along_axis(scores, order, axis=1)
        half = self.kernel // 2
        padded = xp.pad(ranked, [(0, 0), (half, half)])
        n = ranked.shape[1]
        pooled = ranked
        for shift in range(self.kernel):
            if shift != half:
                pooled = xp.maximum(pooled, padded[:, shift : shift + n])
        return xp.take_along_axis(pooled, xp.argsort(order, axis=1), axis=1)
