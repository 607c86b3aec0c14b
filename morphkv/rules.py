"""Eviction rules: each one is a small scoring function over the stored slots.

A rule sees the selection engine (``morphkv.engine.Engine``) after the newest token was
appended and returns one score per stored slot, shape (rows, slots), where rows are the
flattened (batch, KV head) pairs. The engine evicts the lowest-scoring unprotected slot
(the first ``n_sink`` positions and the last ``window`` positions are protected), ties to the
oldest. Scores are float64; non-finite logits count as zero attention.
"""

from __future__ import annotations

import numpy as np


def _exp(logits: np.ndarray, finite: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """exp(logits - row max) and its row sums (1 where a row has no finite logit).
    ``finite`` promises finite logits, which skips the guards."""
    peak = logits.max(axis=-1, keepdims=True)
    if finite:
        weights = np.exp(logits - peak)
        return weights, weights.sum(axis=-1)
    weights = np.exp(logits - np.where(np.isfinite(peak), peak, 0.0))
    total = weights.sum(axis=-1)
    return weights, np.where(total > 0, total, 1.0)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; a row with no finite logit gets all zeros."""
    weights, total = _exp(logits)
    return weights / total[..., None]


def group_attention(logits: np.ndarray) -> np.ndarray:
    """(..., groups, slots) logits -> (..., slots): softmax per query head, summed over the
    query heads that share the KV head (the paper's GQA rule)."""
    return softmax(logits).sum(axis=-2)


class Rule:
    """Base rule. ``attention`` says whether the engine must keep attention logits."""

    attention = False  # needs the ring of window logits
    evicts = True
    observes = False  # needs observe() after every token

    def observe(self, engine) -> None:
        """Called after every appended token (also before the budget is reached)."""

    def score(self, engine) -> np.ndarray:
        raise NotImplementedError


class Full(Rule):
    """No eviction: the reference every other rule is measured against."""

    evicts = False


class Recency(Rule):
    """Evict the oldest unprotected token (``sliding_window``, ``streaming_llm``)."""

    def score(self, engine) -> np.ndarray:
        return engine.stored_positions.astype(np.float64)


class Random(Rule):
    """Evict a uniformly random unprotected token; the draw depends only on
    (seed, row, step, position), so any chunking of a stream makes the same choices."""

    def __init__(self, seed: int) -> None:
        self.seed = np.uint64(seed)

    def score(self, engine) -> np.ndarray:
        rows = np.arange(engine.rows, dtype=np.uint64)[:, None]
        x = engine.stored_positions.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x ^= (rows << np.uint64(40)) ^ np.uint64(engine.seen) ^ (self.seed << np.uint64(20))
        with np.errstate(over="ignore"):  # splitmix64: wrapping multiplies are the point
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return ((x ^ (x >> np.uint64(31))) >> np.uint64(11)).astype(np.float64)


class WindowAttention(Rule):
    """MorphKV: attention of the last ``queries`` window rows, softmax over every stored row,
    fused by mean or max. With ``queries=1`` it is TOVA (the newest query alone)."""

    attention = True

    def __init__(self, fusion: str = "mean", newest_only: bool = False) -> None:
        self.fusion = fusion
        self.newest_only = newest_only

    def score(self, engine) -> np.ndarray:
        if self.newest_only:
            return group_attention(engine.newest_logits())
        logits = engine.window_logits()  # (rows, window, groups, slots)
        if self.fusion == "max":
            return group_attention(logits).max(axis=1)
        R, W, G, J = logits.shape  # mean over the window, as one batched matvec
        weights, total = _exp(logits, engine.finite)
        return (1.0 / total.reshape(R, 1, W * G) @ weights.reshape(R, W * G, J))[:, 0] / W


class Cumulative(Rule):
    """H2O: every new token's attention row is added to a running score per stored token."""

    attention = True
    observes = True

    def observe(self, engine) -> None:
        engine.accumulated[:, : engine.slots] += group_attention(engine.newest_logits())

    def score(self, engine) -> np.ndarray:
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
