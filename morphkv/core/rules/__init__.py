"""Eviction rules: each one a small dataclass that holds its own knobs and scores the stored slots.

A rule sees the selection engine (``morphkv.core.device.DeviceEngine``) when an eviction is due
and returns one score per stored slot, shape (rows, slots), where rows are the flattened
(batch, KV head) pairs. The engine evicts the lowest-scoring unprotected slots (protected: the
first ``n_sink`` positions and the last ``recent`` positions), ties to the oldest. Scores are
>= 0. Rules use the engine's array module ``engine.xp`` (``mlx.core``, float32:
``engine.float``), and read what they declare (``base.Rule``): attention rows
(``window_probs``, ``window_mean``, ``newest_probs``), the running score (``accumulated``), the
stored keys (``slot_keys()``), positions (``stored_positions``).

A new rule: its own file here with one dataclass (its knobs as fields, named as in
``morphkv.core.knobs``), one line in ``METHODS``, and its reference scorer in
``tests/reference.py``; the property tests iterate over ``METHODS``.
"""

from __future__ import annotations

from ..knobs import FIELDS
from .attention import Cumulative, Peak, Tova, WindowAttention
from .base import Array, Rule
from .keydiff import KeyDiff
from .pooled import Pooled
from .recency import Full, Random, Recency, SlidingWindow

METHODS: dict[str, type[Rule]] = {
    "full": Full,
    "sliding_window": SlidingWindow,
    "streaming_llm": Recency,
    "h2o": Cumulative,
    "tova": Tova,
    "morphkv": WindowAttention,
    "peak": Peak,
    "random": Random,
    "keydiff": KeyDiff,
}
GATED = {  # knobs applied around a rule's scores: (off value, what it does, rules it needs)
    "value": (False, "weights attention scores", lambda rule: rule.attention),
    "pool": (1, "pools attention scores", lambda rule: rule.attention),
    "peak": (0, "fuses into a window score", lambda rule: "peak" in rule.knobs()),
    "decay": (1, "decays a peak", lambda rule: "decay" in rule.knobs()),
}


def make_rule(config) -> Rule:
    """The rule object for ``config.method`` (span-pooled when ``morphkv_pool`` > 1); a
    ``ValueError`` naming the config field when a knob is invalid or set for a rule that has
    no use for it."""
    if config.method not in METHODS:
        raise ValueError(f"method={config.method!r} is unknown; valid methods: {sorted(METHODS)}")
    cls = METHODS[config.method]
    for knob, (off, what, needs) in GATED.items():
        if getattr(config, FIELDS[knob]) != off and not needs(cls):
            raise ValueError(f"{FIELDS[knob]} {what}: method={config.method!r} has none")
    rule = cls.from_config(config)
    pooled = Pooled(rule, config.morphkv_pool)  # (checks the kernel)
    return pooled if pooled.kernel > 1 else rule


PIN_SPAN = 5  # keydiff-span, vote-span: neighbours a pinned token's key score is pooled over


def pin_scorer(config) -> Rule | None:
    """What ranks pinned tokens among themselves once they must go (``pin_rank``): None for
    the rule's own score, else a key-geometry rule (``KeyDiff``, span-pooled for
    ``"keydiff-span"``; the votes rank by it where the model-level vote made no room). It
    needs only the stored keys, so it works beside any rule."""
    rank = getattr(config, "pin_rank", "rule")
    if rank == "rule":
        return None
    return Pooled(KeyDiff(), PIN_SPAN) if rank == "keydiff-span" else KeyDiff()


__all__ = ["METHODS", "Array", "Cumulative", "Full", "KeyDiff", "Peak", "Pooled", "Random",
           "Recency", "Rule", "SlidingWindow", "Tova", "WindowAttention", "make_rule",
           "pin_scorer"]
