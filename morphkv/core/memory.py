"""A memory size in bytes per sequence, resolved into tokens per KV head.

A config with ``kv_memory`` set and ``morphkv_budget=0`` asks for "the most tokens that fit in
``kv_memory`` bytes per sequence, over every layer that holds a ``MorphKVCache``", at the
storage precision the config names (``kv_bits``; None: the dtype keys arrive in). The bytes
counted are the caches' own accounting, ``MorphKVCache.nbytes_bound``: K/V storage of
``budget + 1`` slots plus the selection state once the budget is reached, so ``nbytes`` never
exceeds it. ``resolve`` measures that bound on probe caches shaped like the model's layers
(one per distinct shape, a one-token update each) and searches the budget; it copies no
formula, so a change in what a cache holds changes the resolution with it.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx

from .config import KVCacheConfig

UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``"64M"``, ``"1.5G"``, ``"512K"``, ``"4096"`` (binary units; ``MB``/``MiB``
    read as ``M``); ``ValueError`` naming the text otherwise."""
    match = _SIZE.fullmatch(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a size (examples: 64M, 1.5G, 512K, 4096)")
    value = float(match.group(1)) * UNITS[match.group(2).upper()]
    if value < 1:
        raise ValueError(f"{text!r} is not a size of at least one byte")
    return int(value)


def fmt_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


@dataclass(frozen=True)
class LayerShape:
    """What one morphkv layer stores per token: KV heads, key and value head dims, the dtype
    keys arrive in, and the query heads (the attention hook hands them to the cache)."""

    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: mx.Dtype
    query_heads: int


def needs_resolving(config: KVCacheConfig) -> bool:
    """True for a config that asks for a memory size and has no budget yet."""
    return config.kv_memory is not None and config.morphkv_budget == 0


def at_budget(config: KVCacheConfig, budget: int) -> KVCacheConfig:
    """``config`` with ``budget`` tokens per KV head (the recent share applied), validated; at
    budgets too small for a whole eviction block above the sinks and the recent floor, a
    smaller block (as ``recommended(budget)`` does)."""
    sized = dataclasses.replace(config, morphkv_budget=budget)
    room = budget - sized.n_sink - sized.recent
    if room < sized.morphkv_block:
        sized = dataclasses.replace(sized, morphkv_block=max(1, room))
    return sized.validate()


def _probe(config: KVCacheConfig, shape: LayerShape) -> int:
    """The most bytes one cache of ``shape`` built with ``config`` reports holding once full:
    its ``nbytes_bound`` after a chunk that fills it past its budget, and
    its ``nbytes`` and ``nbytes_bound`` at every decode step of one eviction block (state such
    as block eviction's pending queries only exists once the cache runs; a prefill chunk's own
    rows are transient and not counted, as ``morphkv serve`` counts them apart)."""
    from .cache import MorphKVCache
    from .queries import queries_by_hand

    scoring = "attention" if config.scoring in ("auto", "attention") else config.scoring
    config = dataclasses.replace(config, scoring=scoring)
    block = getattr(config, "morphkv_block", 1)

    def step(cache, tokens: int) -> int:
        keys = mx.zeros((1, shape.kv_heads, tokens, shape.key_dim), shape.dtype)
        values = mx.zeros((1, shape.kv_heads, tokens, shape.value_dim), shape.dtype)
        cache.update_and_fetch(keys, values)
        queries = mx.zeros((1, shape.query_heads, tokens, shape.key_dim), mx.float32)
        cache.prepare_attention(queries, shape.key_dim**-0.5, None)
        bound = cache.nbytes_bound
        if bound is None:
            raise ValueError(
                f"kv_memory bounds nothing for method={config.method!r} (never evicts)"
            )
        return max(bound, cache.nbytes) if tokens == 1 else bound  # a chunk's rows pass

    with queries_by_hand():
        cache = MorphKVCache(config)
        most = step(cache, config.budget + block + 1)
        for _ in range(block + 1):
            most = max(most, step(cache, 1))
    return most


def bound_bytes(config: KVCacheConfig, shapes: list[LayerShape]) -> int:
    """The most bytes the caches of ``shapes`` (one per layer) hold with ``config``."""
    return sum(n * _probe(config, shape) for shape, n in Counter(shapes).items())


def _smallest_budget(config: KVCacheConfig) -> int:
    """The smallest budget the config's sinks and recent floor allow."""
    at_budget(config, 2**20)  # a failure at any budget is not about the budget: say it now
    budget = config.n_sink + config.window + 1
    while True:
        try:
            at_budget(config, budget)
            return budget
        except ValueError:
            budget += 1


def resolve(config: KVCacheConfig, shapes: list[LayerShape], fixed=None) -> KVCacheConfig:
    """``config`` with the largest budget whose caches over ``shapes``, plus ``fixed(budget)``
    bytes (the model's other layers: sliding-window layers, fixed-size state), hold at most
    ``kv_memory`` bytes; ``ValueError`` (naming kv_memory) when even the smallest budget the
    sinks and recent tokens need does not fit. A config without a memory size is returned
    as is."""
    if not needs_resolving(config):
        return config
    if not shapes:
        raise ValueError("kv_memory: the model has no layer with a morphkv cache")
    memory = config.kv_memory
    other = fixed or (lambda budget: 0)

    def fits(budget: int) -> tuple[bool, int]:
        held = bound_bytes(at_budget(config, budget), shapes) + other(budget)
        return held <= memory, held

    lo = _smallest_budget(config)
    ok, held_lo = fits(lo)
    if not ok:
        smallest = at_budget(config, lo)
        raise ValueError(
            f"kv_memory={memory} bytes ({fmt_size(memory)}) is too small: the smallest cache "
            f"({lo} tokens per KV head: {smallest.n_sink} sinks + {smallest.recent} newest tokens "
            f"+ 1 scored) holds {held_lo} bytes ({fmt_size(held_lo)}) over {len(shapes)} layers"
            + (f", {fmt_size(other(lo))} of them in the layers morphkv does not replace "
               "(sliding-window layers, fixed-size state)" if other(lo) else "")
        )
    hi, held_hi = 2 * lo, None
    while True:  # bracket: lo fits, hi does not
        ok, held = fits(hi)
        if not ok:
            held_hi = held
            break
        lo, held_lo, hi = hi, held, 2 * hi
    for step in range(64):  # bytes grow about linearly in the budget: interpolate, then bisect
        if hi - lo <= 1:
            break
        guess = lo + int((memory - held_lo) * (hi - lo) / max(held_hi - held_lo, 1))
        mid = min(max(guess, lo + 1), hi - 1) if step < 4 else (lo + hi) // 2
        ok, held = fits(mid)
        if ok:
            lo, held_lo = mid, held
            if mid + 1 < hi:
                ok, held = fits(mid + 1)
                lo, held_lo, hi, held_hi = (
                    (mid + 1, held, hi, held_hi) if ok else (lo, held_lo, mid + 1, held)
                )
        else:
            hi, held_hi = mid, held
    return at_budget(config, lo)
