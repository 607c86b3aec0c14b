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
    """Base rule. Each rule declares the statistics it reads, and the engines (host and MLX)
    keep exactly those: ``attention`` (attention rows at all), ``window_rows`` (``"all"``:
    the last ``window`` tokens' rows, ``"newest"``: the newest token's row, None: neither),
    ``running`` (a running score per slot: ``"sum"`` for h2o, ``"peak"`` for a running max
    decaying by ``decay``; None: none)."""

    attention = False  # needs attention rows
    evicts = True
    observes = False  # keeps a running score per slot (the engine updates it: h2o, peak)
    window_rows: str | None = None
    running: str | None = None
    decay = 1.0

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
    mean or max over the window. ``newest_only`` gives TOVA. With ``peak`` = lambda > 0 the
    score is ``max(window score, lambda * peak)``, peak the running (``decay``-ing) maximum of
    the attention each token has received (kept by the engine): a token the conversation attended
    to strongly once keeps a share of that attention while the window moves on."""

    attention = True

    def __init__(
        self, fusion: str = "mean", newest_only: bool = False, peak: float = 0.0, decay: float = 1.0
    ) -> None:
        self.fusion = fusion
        self.newest_only = newest_only
        self.peak, self.decay = float(peak), float(decay)
        self.observes = self.peak > 0
        self.window_rows = "newest" if newest_only else "all"
        self.running = "peak" if self.observes else None

    def score(self, engine) -> Array:
        if self.newest_only:
            window = engine.newest_probs().astype(engine.float)
        elif self.fusion == "max":  # rows (rows, window, slots), GQA: summed over the group
            window = engine.window_probs().max(axis=1).astype(engine.float)
        else:
            window = engine.window_mean()
        if not self.observes:
            return window
        peak = engine.accumulated[:, : engine.slots].astype(engine.float)
        return engine.xp.maximum(window, self.peak * peak)


class Peak(Rule):
    """Peak attention (Scissorhands-like persistence): a token's score is the largest attention
    it ever received from one query (summed over a KV group's heads), decaying by ``decay`` per
    token since; a running max instead of H2O's running sum, O(slots) per step."""

    attention = True
    observes = True
    running = "peak"

    def __init__(self, decay: float = 1.0) -> None:
        self.decay = float(decay)

    def score(self, engine) -> Array:
        return engine.accumulated[:, : engine.slots].astype(engine.float)


class Pooled(Rule):
    """Span pooling (SnapKV-style) around another rule: each unprotected slot's score becomes
    the largest score among the ``kernel`` stored tokens centred on it in position order
    (protected tokens count as 0), so the neighbouring sub-word tokens of a fact rise and fall
    together. Scores stay >= 0; eviction still picks one slot per step."""

    def __init__(self, inner: Rule, kernel: int) -> None:
        self.inner, self.kernel = inner, kernel
        self.attention, self.evicts, self.observes = inner.attention, inner.evicts, inner.observes
        self.window_rows, self.running, self.decay = inner.window_rows, inner.running, inner.decay

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


class Cumulative(Rule):
    """H2O: every new token's attention row is added to a running score per stored token."""

    attention = True
    observes = True
    running = "sum"

    def score(self, engine) -> Array:
        return engine.accumulated[:, : engine.slots].astype(engine.float)


def make_rule(config) -> Rule:
    """The rule object for ``config.method`` (span-pooled when ``morphkv_pool`` > 1)."""
    rule = METHODS[config.method](config)
    if getattr(config, "morphkv_pool", 1) > 1:
        rule = Pooled(rule, config.morphkv_pool)
    return rule


METHODS = {
    "full": lambda c: Full(),
    "sliding_window": lambda c: Recency(),
    "streaming_llm": lambda c: Recency(),
    "h2o": lambda c: Cumulative(),
    "tova": lambda c: WindowAttention(
        newest_only=True, peak=c.morphkv_peak, decay=c.morphkv_decay
    ),
    "morphkv": lambda c: WindowAttention(
        fusion=c.morphkv_fusion, peak=c.morphkv_peak, decay=c.morphkv_decay
    ),
    "peak": lambda c: Peak(c.morphkv_decay),
    "random": lambda c: Random(c.seed),
}
