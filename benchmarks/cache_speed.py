"""Per-layer cache update cost, side by side with mlx_lm's RotatingKVCache (issue 2 targets).

One layer, B=1, 4 KV heads, head_dim 64, float16, window 8, 4 sinks. Prints medians and writes
results/cache_speed.json. Run: python benchmarks/cache_speed.py [--budget 512] [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from morphkv import KVCacheBuilder, KVCacheConfig


def stream(n: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    k = mx.random.normal((1, 4, n, 64)).astype(mx.float16)
    v = mx.random.normal((1, 4, n, 64)).astype(mx.float16)
    mx.eval(k, v)
    return k, v


def timed_update(cache, k, v) -> float:
    """Seconds of one update, its selection step included (morphkv runs a token's engine
    step lazily, at the next update or read: reading tokens_kept forces it here)."""
    start = time.perf_counter()
    mx.eval(cache.update_and_fetch(k, v))
    getattr(cache, "tokens_kept", None)
    return time.perf_counter() - start


def decode_costs(method: str, budget: int, repeats: int, k, v) -> dict[str, float]:
    """Median seconds per single-token update once the cache is full, for morphkv's cache and
    mlx_lm's RotatingKVCache of the same size, interleaved token by token."""
    ours = KVCacheBuilder.build(
        KVCacheConfig(method=method, morphkv_budget=budget, morphkv_n_sink=4, morphkv_window=8)
    )
    theirs = RotatingKVCache(max_size=budget, keep=4)
    warm = budget + 16
    for cache in (ours, theirs):
        cache.update_and_fetch(k[:, :, :warm], v[:, :, :warm])
        for t in range(warm, warm + 8):  # the rotating cache switches to in-place updates
            cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    times = {"morphkv": [], "rotating": []}
    tokens = [(k[:, :, t : t + 1], v[:, :, t : t + 1]) for t in range(warm + 8, warm + 8 + repeats)]
    mx.eval(tokens)
    for kt, vt in tokens:
        times["morphkv"].append(timed_update(ours, kt, vt))
        times["rotating"].append(timed_update(theirs, kt, vt))
    return {name: statistics.median(ts) for name, ts in times.items()}


def chunk_cost(method: str, budget: int, k, v, repeats: int = 5) -> float:
    """Median seconds of one 2048-token update into an empty cache."""
    times = []
    for _ in range(repeats):
        cache = KVCacheBuilder.build(
            KVCacheConfig(method=method, morphkv_budget=budget, morphkv_n_sink=4, morphkv_window=8)
        )
        times.append(timed_update(cache, k[:, :, :2048], v[:, :, :2048]))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--methods", default="morphkv,h2o,tova,streaming_llm,random")
    parser.add_argument("--out", default="results/cache_speed.json")
    args = parser.parse_args()
    k, v = stream(max(2048, args.budget + 24 + args.repeats))
    rows = []
    print(f"budget {args.budget}, B=1, 4 KV heads, head_dim 64, float16, window 8, 4 sinks")
    print(
        f"{'method':<14} {'decode us':>10} {'rotating us':>12} {'ratio':>6} {'2048-chunk ms':>14}"
    )
    for method in args.methods.split(","):
        decode = decode_costs(method, args.budget, args.repeats, k, v)
        chunk = chunk_cost(method, args.budget, k, v)
        ratio = decode["morphkv"] / decode["rotating"]
        rows.append(
            dict(
                method=method,
                decode_us=decode["morphkv"] * 1e6,
                rotating_us=decode["rotating"] * 1e6,
                decode_ratio=ratio,
                chunk2048_ms=chunk * 1e3,
            )
        )
        print(
            f"{method:<14} {decode['morphkv'] * 1e6:>10.0f} {decode['rotating'] * 1e6:>12.0f} "
            f"{ratio:>6.2f} {chunk * 1e3:>14.1f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"budget": args.budget, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
