"""KeyDiff (Park et al., arXiv:2504.15364; kvpress's ``KeyDiffPress``): key geometry alone.

Per KV head, the anchor is the mean of the stored keys' unit vectors; a key pointing where
most keys point adds little, so the score is ``1 - cos(key, anchor)`` (kvpress's ``-cos``
shifted to >= 0: the same order). No attention: no queries, no rows, no running state; it would
run beside a fused attention kernel. A zero key (or anchor) has cosine 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Array, Rule


def unit(xp, x: Array) -> Array:
    norm = xp.sqrt((x * x).sum(axis=-1, keepdims=True))
    return x / xp.where(norm > 0, norm, 1.0)


@dataclass(frozen=True)
class KeyDiff(Rule):
    """Evict the unprotected key most similar in direction to the mean stored key."""

    scheduled = "keydiff"

    def score(self, engine) -> Array:
        xp = engine.xp
        keys = unit(xp, engine.slot_keys().astype(engine.float))  # (rows, slots, D)
        anchor = unit(xp, keys.mean(axis=1, keepdims=True))
        return xp.maximum(1.0 - (keys * anchor).sum(axis=-1), 0.0)
