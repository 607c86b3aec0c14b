"""Per-layer micro benchmark behind ``morphkv bench speed --micro``: the cost of one cache
update (a decode step with the cache full, and one multi-token chunk) across budgets and
windows, side by side with mlx_lm's RotatingKVCache of the same size."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


def _time_update(cache, keys, values) -> float:
    import mlx.core as mx

    t0 = time.perf_counter()
    k, v = cache.update_and_fetch(keys, values)
    mx.eval(k, v)
    getattr(cache, "tokens_kept", None)  # morphkv runs the selection step when first read
    return time.perf_counter() - t0


def _micro_cache(kind: str, budget: int, window: int, n_sink: int = 4):
    from mlx_lm.models.cache import RotatingKVCache

    if kind == "rotating":
        return RotatingKVCache(max_size=budget, keep=n_sink)
    from morphkv import KVCacheBuilder, KVCacheConfig

    return KVCacheBuilder.build(
        KVCacheConfig(
            method=kind, morphkv_budget=budget, morphkv_window=window, morphkv_n_sink=n_sink
        )
    )


def micro_case(
    kind: str, budget: int, window: int, decode_repeats: int, chunk: int, chunk_repeats: int
) -> dict:
    """Median seconds of one decode update (cache full, evicting) and one ``chunk``-token
    update into a full cache, B=1, 4 KV heads, head_dim 64, float16."""
    import mlx.core as mx

    B, H, D = 1, 4, 64
    warm = 16
    total = budget + warm + decode_repeats
    stream = mx.random.normal((B, H, total + chunk, D)).astype(mx.float16)
    mx.eval(stream)
    cache = _micro_cache(kind, budget, window)
    prefix = stream[:, :, :budget]
    cache.update_and_fetch(prefix, prefix)
    decode = []
    for i in range(budget, total):
        x = stream[:, :, i : i + 1]
        dt = _time_update(cache, x, x)
        if i >= budget + warm:
            decode.append(dt)
    chunked = []
    for _ in range(chunk_repeats):
        cache = _micro_cache(kind, budget, window)
        cache.update_and_fetch(prefix, prefix)
        one = stream[:, :, budget : budget + 1]
        _time_update(cache, one, one)  # now full and evicting
        x = stream[:, :, total : total + chunk]
        chunked.append(_time_update(cache, x, x))
    return {
        "kind": kind,
        "budget": budget,
        "window": window,
        "decode_ms": 1e3 * float(np.median(decode)),
        "decode_repeats": len(decode),
        "chunk_tokens": chunk,
        "chunk_ms": 1e3 * float(np.median(chunked)),
        "chunk_repeats": len(chunked),
    }


def run_micro(args: argparse.Namespace) -> dict:
    if args.quick:
        budgets, windows, sweep_budget, sweep_windows = [32, 64], [1, 4], 64, [1, 2, 4, 8]
        decode_repeats, chunk, chunk_repeats = args.repeats or 20, 128, 1
        methods = ["h2o", "tova", "streaming_llm"]
    else:
        budgets, windows = [128, 256, 512, 1024, 2048], [1, 8, 64]
        sweep_budget, sweep_windows = 512, [1, 2, 4, 8, 16, 32, 64]
        decode_repeats, chunk, chunk_repeats = args.repeats or 200, 2048, 3
        methods = ["h2o", "tova", "streaming_llm"]
    cases = [("rotating", b, 0) for b in budgets]
    cases += [("morphkv", b, w) for b in budgets for w in windows]
    cases += [("morphkv", sweep_budget, w) for w in sweep_windows if w not in windows]
    cases += [(m, sweep_budget, min(8, windows[-1])) for m in methods]
    rows = []
    t0 = time.time()
    for i, (kind, b, w) in enumerate(cases):
        rows.append(micro_case(kind, b, w, decode_repeats, chunk, chunk_repeats))
        r = rows[-1]
        sys.stderr.write(
            f"\r[micro] {i + 1}/{len(cases)} {kind} b={b} w={w}: decode {r['decode_ms']:.3f} ms, "
            f"{chunk}-token {r['chunk_ms']:.1f} ms ({time.time() - t0:.0f}s)   "
        )
        sys.stderr.flush()
    sys.stderr.write("\n")
    return {"rows": rows, "chunk_tokens": chunk, "wall_s": time.time() - t0}


def format_micro(result: dict) -> str:
    rows = result["rows"]
    rot = {r["budget"]: r for r in rows if r["kind"] == "rotating"}
    chunk = result["chunk_tokens"]
    lines = [
        f"{'kind':>14} {'budget':>6} {'window':>6} {'decode ms':>10} {'x rotating':>10} "
        f"{f'{chunk}-tok ms':>11} {'x rotating':>10}"
    ]
    for r in rows:
        ref = rot.get(r["budget"])
        dx = f"{r['decode_ms'] / ref['decode_ms']:.1f}" if ref else "-"
        cx = f"{r['chunk_ms'] / ref['chunk_ms']:.1f}" if ref else "-"
        w = "-" if r["kind"] == "rotating" else str(r["window"])
        lines.append(
            f"{r['kind']:>14} {r['budget']:>6} {w:>6} {r['decode_ms']:>10.3f} {dx:>10} "
            f"{r['chunk_ms']:>11.1f} {cx:>10}"
        )
    return "\n".join(lines)


def plot_micro(result: dict, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    rot = sorted((r for r in rows if r["kind"] == "rotating"), key=lambda r: r["budget"])
    windows = sorted({r["window"] for r in rows if r["kind"] == "morphkv"})
    budgets = sorted({r["budget"] for r in rows if r["kind"] == "morphkv"})
    for ax, field, title in (
        (axes[0], "decode_ms", "one decode update (evicting)"),
        (axes[1], "chunk_ms", f"one {result['chunk_tokens']}-token update"),
    ):
        ax.plot([r["budget"] for r in rot], [r[field] for r in rot], "k--o", label="Rotating")
        for w in windows:
            pts = sorted(
                (r for r in rows if r["kind"] == "morphkv" and r["window"] == w),
                key=lambda r: r["budget"],
            )
            if len(pts) > 1:
                ax.plot([r["budget"] for r in pts], [r[field] for r in pts], "-o", label=f"w={w}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("budget (tokens)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[2]
    for b in budgets:
        pts = sorted(
            (r for r in rows if r["kind"] == "morphkv" and r["budget"] == b),
            key=lambda r: r["window"],
        )
        if len(pts) > 2:
            ax.plot([r["window"] for r in pts], [r["decode_ms"] for r in pts], "-o", label=f"b={b}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("window")
    ax.set_ylabel("decode ms")
    ax.set_title("decode update vs window")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle("Per-layer cache update cost (B=1, 4 KV heads, head_dim 64, float16)")
    png = out / "micro.png"
    fig.savefig(png, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return str(png)
