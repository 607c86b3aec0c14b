"""Named settings: the recommended one (chosen on evidence, see docs/results.md and
docs/recall.md) and the paper's.

``recommended(budget)`` is what ``morphkv generate`` and ``morphkv serve`` use by default:
MorphKV's real-query ranking of the older tokens, plus a recency floor (the newest half of the
budget is always kept: on self-generated text recency is what matters), value-weighted scores
(a token whose value vector is small adds little to the output) and persistence: a token's
score is ``max(window mean, PEAK x the largest attention it ever received)``, so a fact the
conversation attended to strongly once is not evicted as soon as the talk moves on (chosen on
the tune items and texts of ``morphkv eval recall`` / ``morphkv eval sweep``, docs/recall.md).
``paper(budget)`` is the rule as published (recent region = query window), evicting in blocks
of 8 as the paper's coarse variant did (``morphkv_block=1`` for its per-token rule).
"""

from __future__ import annotations

from collections.abc import Callable

from .config import KVCacheConfig

N_SINK = 4
WINDOW = 16
PEAK = 0.02  # peak fusion lambda: best tune retention with tune KL below StreamingLLM
PAPER_BLOCK = 8  # the paper's coarse eviction: every 8 steps (-0.9 accuracy points, 0.82x time)


def recommended(budget: int = 512, **overrides) -> KVCacheConfig:
    """The recommended MorphKV setting for ``budget`` tokens per sequence and KV head;
    keyword arguments override any ``KVCacheConfig`` field."""
    window = overrides.get("morphkv_window", WINDOW)
    fields = dict(
        method="morphkv",
        morphkv_budget=budget,
        morphkv_n_sink=N_SINK,
        morphkv_window=window,
        morphkv_recent=max(window, budget // 2),
        morphkv_value=True,
        morphkv_peak=PEAK,
    )
    fields.update(overrides)
    return KVCacheConfig(**fields).validate()


def paper(budget: int = 512, **overrides) -> KVCacheConfig:
    """MorphKV as published: window 8 of real queries, mean fusion, nothing else protected,
    evicting in blocks of ``PAPER_BLOCK`` tokens (the paper's coarse variant)."""
    fields = dict(method="morphkv", morphkv_budget=budget, morphkv_n_sink=N_SINK,
                  morphkv_block=PAPER_BLOCK)
    fields.update(overrides)
    return KVCacheConfig(**fields).validate()


PRESETS: dict[str, Callable[..., KVCacheConfig]] = {"recommended": recommended, "paper": paper}
