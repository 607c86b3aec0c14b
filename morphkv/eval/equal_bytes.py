"""Equal bytes: the budget at which an arm's caches hold a target number of bytes, measured.

Bytes are measured, never computed from a formula: the arm's caches are built for the model
and fed a short random token stream that runs past the budget; ``metrics.held_bytes`` counts
everything each cache holds (storage, and the selection engine's state). So an arm with a
larger engine, or quantized storage, gets the budget its bytes allow.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from .arms import Arm
from .metrics import held_bytes

MAX_BUDGET = 1 << 16


def measure_bytes(model, arm: Arm, budget: int, n_sink: int = 4, extra: int = 16) -> int:
    """Bytes held by all of ``arm``'s caches for ``model`` after ``budget + window + extra``
    random tokens (one prefill chunk, then one decode step)."""
    caches = arm.caches(model, budget, n_sink)
    n = budget + arm.window + extra
    vocab = int(model.args.vocab_size)
    ids = mx.random.randint(0, vocab, (1, n + 1), key=mx.random.key(budget))
    mx.eval(model(ids[:, :n], cache=caches))
    mx.eval(model(ids[:, n:], cache=caches))
    return sum(held_bytes(c) for c in caches)


def _valid(arm: Arm, budget: int, n_sink: int) -> bool:
    if arm.is_baseline:
        return True
    try:
        arm.config(budget, n_sink=n_sink)
    except ValueError:
        return False
    return True


def budget_for_bytes(model, arm: Arm, target: int, n_sink: int = 4) -> tuple[int, int]:
    """(budget, bytes): the largest budget whose measured bytes do not exceed ``target``."""
    if arm.method == "kvcache":
        raise ValueError("arm kvcache grows with the text: no budget bounds its bytes")

    @cache
    def size(b: int) -> int:
        return measure_bytes(model, arm, b, n_sink)

    lo = n_sink + arm.window + 1
    while not _valid(arm, lo, n_sink):  # a recency floor (recent > window) needs more
        lo += 1
        if lo > MAX_BUDGET:
            raise ValueError(f"arm {arm.name} has no valid budget up to {MAX_BUDGET}")
    if size(lo) > target:
        raise ValueError(
            f"arm {arm.name} holds {size(lo)} bytes at its smallest budget {lo}: more than "
            f"the target {target}"
        )
    hi = lo
    while size(hi) <= target:  # grow until over the target
        lo, hi = hi, hi * 2
        if hi > MAX_BUDGET:
            raise ValueError(f"arm {arm.name} stays under {target} bytes up to {MAX_BUDGET}")
    while hi - lo > 1:  # size(lo) <= target < size(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= target else (lo, mid)
    return lo, size(lo)


def equal_byte_budgets(model, arms: list[Arm], reference: Arm, budgets, n_sink: int = 4):
    """{(arm name, budget): (arm budget, bytes, target)}: each arm at the bytes the reference
    arm holds at each budget."""
    out = {}
    for b in budgets:
        target = measure_bytes(model, reference, b, n_sink)
        for arm in arms:
            out[(arm.name, b)] = (*budget_for_bytes(model, arm, target, n_sink), target)
    return out
