"""The stats block ``morphkv generate`` prints after its answer: what the cache saw and kept."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..core import quant
from ..core.memory import fmt_size as fmt_bytes
from ..mlxlm.layout import morph_caches
from ..runtime.cache_flags import describe

RULE = "=========="


@dataclass
class CacheStats:
    layers: int
    batch: int
    kv_heads: int
    tokens_seen: int  # per sequence and KV head
    tokens_kept: int  # per sequence and KV head (mean over layers)
    kept_bytes: int  # K+V bytes kept, summed over layers, batch and KV heads
    full_bytes: int  # K+V bytes a full cache would hold, same sum
    storage_bytes: int  # allocated K/V storage, summed over layers
    engine_bytes: int = 0  # selection state, summed over layers
    pinned: int = 0  # positions pinned (evicted last), per sequence: the most of any layer

    @property
    def compression_ratio(self) -> float:
        return self.full_bytes / self.kept_bytes if self.kept_bytes else 1.0

    @property
    def evicted(self) -> int:
        return max(self.tokens_seen - self.tokens_kept, 0)


def cache_stats(caches) -> CacheStats:
    """Totals over the per-layer caches (their counters are per sequence per KV head)."""
    kept_bytes = full_bytes = storage = engine = kept_sum = 0
    seen = batch = heads = pinned = 0
    for c in caches:
        keys = getattr(c, "keys", None)
        b, h = quant.dims(keys)[:2] if keys is not None else (0, 0)  # plain or quantized
        batch, heads = max(batch, b), max(heads, h)
        kept_bytes += c.morphkv_kept_bytes * b * h
        full_bytes += c.full_seq_bytes * b * h
        storage += getattr(c, "storage_nbytes", c.nbytes)
        engine += getattr(c, "engine_nbytes", 0)
        kept_sum += c.tokens_kept
        seen = max(seen, c.tokens_seen)
        pins = getattr(c, "pins", None)
        pinned = max(pinned, len(pins) if pins is not None else 0)
    n = len(caches)
    return CacheStats(
        layers=n,
        batch=batch,
        kv_heads=heads,
        tokens_seen=seen,
        tokens_kept=round(kept_sum / n) if n else 0,
        kept_bytes=kept_bytes,
        full_bytes=full_bytes,
        storage_bytes=storage,
        engine_bytes=engine,
        pinned=pinned,
    )


def eviction_note(stats: CacheStats, config) -> str | None:
    """One line saying why nothing was evicted, or None when the cache did evict."""
    if not config.rule.evicts:
        return (f"method={config.method} never evicts (the reference the other methods are "
                "measured against)")
    if stats.evicted:
        return None
    return (
        f"nothing evicted yet: all {stats.tokens_seen} tokens fit in the budget of "
        f"{config.budget}; eviction starts at token {config.budget + 1} (use a smaller --budget "
        "or a longer answer, --max-tokens)"
    )


def format_stats(resp, stats: CacheStats, peak_gb: float, config) -> str:
    """The block printed after the answer; ``resp`` is mlx_lm's last GenerationResponse."""
    kept_share = stats.kept_bytes / stats.full_bytes if stats.full_bytes else 1.0
    lines = [
        RULE,
        f"Prompt:      {resp.prompt_tokens} tokens, {resp.prompt_tps:.3f} tokens-per-sec",
        f"Generation:  {resp.generation_tokens} tokens, {resp.generation_tps:.3f} tokens-per-sec",
        f"KV cache:    {describe(config)} ({stats.layers} layers x batch {stats.batch} x "
        f"{stats.kv_heads} KV heads)",
        f"Tokens:      seen {stats.tokens_seen}, kept {stats.tokens_kept}, evicted "
        f"{stats.evicted} (per sequence per KV head)"
        + (f"; {stats.pinned} prompt tokens pinned (evicted last; --pin none: off)"
           if stats.pinned else ""),
        f"KV bytes:    kept {fmt_bytes(stats.kept_bytes)} vs full cache "
        f"{fmt_bytes(stats.full_bytes)} (K+V, summed over layers, batch and KV heads)",
        f"Compression: {stats.compression_ratio:.2f}x (the cache holds {100 * kept_share:.0f}% "
        "of a full cache's K+V)",
        f"Cache memory: {fmt_bytes(stats.storage_bytes + stats.engine_bytes)} held = K/V storage "
        f"{fmt_bytes(stats.storage_bytes)} + selection state {fmt_bytes(stats.engine_bytes)}",
    ]
    if getattr(config, "kv_memory", None) is not None:
        held = stats.storage_bytes + stats.engine_bytes
        lines.append(
            f"KV memory:   asked {fmt_bytes(config.kv_memory)} per sequence (--kv-memory), held "
            f"{fmt_bytes(held)} ({100 * held / config.kv_memory:.0f}%); resolved to "
            f"{config.budget} tokens per KV head"
            + (f" at {config.kv_bits} bits" if config.kv_bits else "")
        )
    note = eviction_note(stats, config)
    if note:
        lines.append(f"Note:        {note}")
    lines.append(f"Peak memory: {peak_gb:.3f} GB")
    return "\n".join(lines)


def other_layers(caches) -> str | None:
    """One line for the layers morphkv leaves to mlx_lm (Gemma 3's sliding-window layers ...):
    their caches, bounds and bytes; None when morphkv bounds every layer."""
    from ..mlxlm.layout import describe_layout

    morph = {id(c) for c in morph_caches(caches)}
    rest = [c for c in caches if id(c) not in morph]
    if not rest or len(rest) == len(caches):
        return None
    held = sum(getattr(c, "nbytes", 0) for c in rest)
    layout = describe_layout(caches).splitlines()
    kept = "; ".join(x for x in layout if "morphkv" not in x and " budget " not in x)
    return f"Other layers: {kept}; {fmt_bytes(held)} held (not in the figures above)"


def blas_status() -> str:
    """Whether MLX runs with the preloaded OpenBLAS (Linux CPU) in this process."""
    from ..runtime.blas import find_blas, is_preloaded

    if not sys.platform.startswith("linux"):
        return "platform default"
    lib = find_blas()
    if lib is None:
        return "MLX default (no OpenBLAS found or preload disabled; see morphkv.runtime.blas)"
    return f"preloaded {lib}" if is_preloaded(lib) else f"not preloaded ({lib} available)"
