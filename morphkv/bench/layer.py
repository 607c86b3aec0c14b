"""Per-layer cache update cost, side by side with mlx_lm's RotatingKVCache of the same size.

One layer, B=1, 4 KV heads, head_dim 64, float16, 4 sinks. Default: per method at one budget,
the median single-token update once the cache is full (interleaved token by token with a
RotatingKVCache) and one 2,048-token update into an empty cache. ``--grid``: the cost of a
decode step and of one chunk across budgets and windows (also ``morphkv bench speed --micro``).
Each update is timed with its selection step (read ``tokens_kept`` to force the deferred step).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx

from . import plots
from ._util import (
    Progress,
    csv_strs,
    environment,
    markdown_table,
    out_dir,
    require_matplotlib,
    write_json,
)
from .arms import Arm

NAME = "layer"
B, H, D = 1, 4, 64


def stream(n: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    k = mx.random.normal((B, H, n, D)).astype(mx.float16)
    v = mx.random.normal((B, H, n, D)).astype(mx.float16)
    mx.eval(k, v)
    return k, v


def timed_update(cache, k, v) -> float:
    start = time.perf_counter()
    mx.eval(cache.update_and_fetch(k, v))
    getattr(cache, "tokens_kept", None)  # morphkv runs a token's selection step when read
    return time.perf_counter() - start


def make_cache(spec: str, budget: int, window: int = 8, n_sink: int = 4):
    from mlx_lm.models.cache import RotatingKVCache

    if spec == "rotating":
        return RotatingKVCache(max_size=budget, keep=n_sink)
    from .. import KVCacheBuilder

    return KVCacheBuilder.build(Arm.parse(spec, window=window).config(budget, n_sink=n_sink))


def decode_costs(spec: str, budget: int, repeats: int, k, v, window: int = 8) -> dict:
    """Median seconds per single-token update once full, for the arm and a RotatingKVCache of
    the same size, interleaved token by token."""
    caches = {
        "morphkv": make_cache(spec, budget, window),
        "rotating": make_cache("rotating", budget),
    }
    warm = budget + 16
    for cache in caches.values():
        cache.update_and_fetch(k[:, :, :warm], v[:, :, :warm])
        for t in range(warm, warm + 8):  # the rotating cache switches to in-place updates
            cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    tokens = [(k[:, :, t : t + 1], v[:, :, t : t + 1]) for t in range(warm + 8, warm + 8 + repeats)]
    mx.eval(tokens)
    times = {name: [] for name in caches}
    for kt, vt in tokens:
        for name, cache in caches.items():
            times[name].append(timed_update(cache, kt, vt))
    return {name: statistics.median(ts) for name, ts in times.items()}


def chunk_cost(spec: str, budget: int, k, v, tokens: int = 2048, repeats: int = 5, window=8):
    """Median seconds of one ``tokens``-token update into an empty cache."""
    return statistics.median(
        timed_update(make_cache(spec, budget, window), k[:, :, :tokens], v[:, :, :tokens])
        for _ in range(repeats)
    )


def run_methods(methods, budget: int, repeats: int, quiet: bool = False) -> dict:
    k, v = stream(max(2048, budget + 24 + repeats))
    bar, rows = Progress(len(methods), NAME, quiet), []
    for method in methods:
        d = decode_costs(method, budget, repeats, k, v)
        c = chunk_cost(method, budget, k, v)
        rows.append(
            dict(
                method=method,
                decode_us=d["morphkv"] * 1e6,
                rotating_us=d["rotating"] * 1e6,
                decode_ratio=d["morphkv"] / d["rotating"],
                chunk2048_ms=c * 1e3,
            )
        )
        bar.update(1, method)
    return {"benchmark": NAME, "budget": budget, "repeats": repeats, "rows": rows}


def grid_case(spec: str, budget: int, window: int, repeats: int, chunk: int, chunk_repeats: int):
    """One ``--grid`` point: median decode update (full, evicting) and one ``chunk`` update."""
    warm, total = 16, budget + 16 + repeats
    s = mx.random.normal((B, H, total + chunk, D)).astype(mx.float16)
    mx.eval(s)
    prefix = s[:, :, :budget]
    cache = make_cache(spec, budget, window)
    cache.update_and_fetch(prefix, prefix)
    decode = [
        timed_update(cache, s[:, :, i : i + 1], s[:, :, i : i + 1]) for i in range(budget, total)
    ]
    chunked = []
    for _ in range(chunk_repeats):
        cache = make_cache(spec, budget, window)
        cache.update_and_fetch(prefix, prefix)
        timed_update(cache, s[:, :, budget : budget + 1], s[:, :, budget : budget + 1])  # evicting
        chunked.append(
            timed_update(cache, s[:, :, total : total + chunk], s[:, :, total : total + chunk])
        )
    return {
        "kind": spec,
        "budget": budget,
        "window": window,
        "decode_ms": 1e3 * statistics.median(decode[warm:]),
        "decode_repeats": len(decode[warm:]),
        "chunk_tokens": chunk,
        "chunk_ms": 1e3 * statistics.median(chunked),
        "chunk_repeats": len(chunked),
    }


def run_grid(quick: bool, repeats: int = 0) -> dict:
    if quick:
        budgets, windows, sweep_budget, sweep_windows = [32, 64], [1, 4], 64, [1, 2, 4, 8]
        repeats, chunk, chunk_repeats = repeats or 20, 128, 1
    else:
        budgets, windows = [128, 256, 512, 1024, 2048], [1, 8, 64]
        sweep_budget, sweep_windows = 512, [1, 2, 4, 8, 16, 32, 64]
        repeats, chunk, chunk_repeats = repeats or 200, 2048, 3
    cases = [("rotating", b, 0) for b in budgets] + [
        ("morphkv", b, w) for b in budgets for w in windows
    ]
    cases += [("morphkv", sweep_budget, w) for w in sweep_windows if w not in windows]
    cases += [(m, sweep_budget, min(8, windows[-1])) for m in ("h2o", "tova", "streaming_llm")]
    bar, t0 = Progress(len(cases), "micro"), time.time()
    rows = []
    for kind, b, w in cases:
        rows.append(grid_case(kind, b, w, repeats, chunk, chunk_repeats))
        bar.update(1, f"{kind} b={b} w={w}: decode {rows[-1]['decode_ms']:.3f} ms")
    return {"rows": rows, "chunk_tokens": chunk, "wall_s": time.time() - t0}


def grid_table(result: dict) -> str:
    rot = {r["budget"]: r for r in result["rows"] if r["kind"] == "rotating"}
    body = [
        [
            r["kind"],
            r["budget"],
            "-" if r["kind"] == "rotating" else r["window"],
            r["decode_ms"],
            r["decode_ms"] / rot[r["budget"]]["decode_ms"] if r["budget"] in rot else float("nan"),
            r["chunk_ms"],
            r["chunk_ms"] / rot[r["budget"]]["chunk_ms"] if r["budget"] in rot else float("nan"),
        ]
        for r in result["rows"]
    ]
    chunk = result["chunk_tokens"]
    return markdown_table(
        ["kind", "budget", "window", "decode ms", "x rotating", f"{chunk}-token ms", "x rotating"],
        body,
    )


def plot_grid(result: dict, out: Path) -> str:
    rows = result["rows"]
    morph = [r for r in rows if r["kind"] == "morphkv"]
    rot = sorted((r for r in rows if r["kind"] == "rotating"), key=lambda r: r["budget"])
    fig, axes = plots.panels(3, 5.6, 5)
    for ax, field, title in (
        (axes[0, 0], "decode_ms", "one decode update (evicting)"),
        (axes[0, 1], "chunk_ms", f"one {result['chunk_tokens']}-token update"),
    ):
        series = {"Rotating": ([r["budget"] for r in rot], [r[field] for r in rot])}
        for w in sorted({r["window"] for r in morph}):
            pts = sorted((r for r in morph if r["window"] == w), key=lambda r: r["budget"])
            if len(pts) > 1:
                series[f"w={w}"] = ([r["budget"] for r in pts], [r[field] for r in pts])
        plots.lines(ax, series, "budget (tokens)", "ms", title, log=True)
    series = {}
    for b in sorted({r["budget"] for r in morph}):
        pts = sorted((r for r in morph if r["budget"] == b), key=lambda r: r["window"])
        if len(pts) > 2:
            series[f"b={b}"] = ([r["window"] for r in pts], [r["decode_ms"] for r in pts])
    plots.lines(axes[0, 2], series, "window", "decode ms", "decode update vs window", log=True)
    fig.suptitle("Per-layer cache update cost (B=1, 4 KV heads, head_dim 64, float16)")
    return plots.save(fig, out / "micro.png", 100)


def run_grid_command(args: argparse.Namespace) -> dict:
    """The ``--grid`` run: JSON ``micro[_quick].json`` and ``micro.png`` under ``args.out``."""
    out = Path(args.out) if args.out else Path("results") / NAME
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "micro",
        "args": {k: v for k, v in vars(args).items() if k != "worker"},
        "environment": environment(),
        **run_grid(args.quick, args.repeats),
    }
    print(grid_table(result))
    if not getattr(args, "no_plot", False):
        result["plots"] = [plot_grid(result, out)]
    path = write_json(out / f"micro{'_quick' if args.quick else ''}.json", result)
    print(f"wrote {path}")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", type=int, default=512, help="default 512")
    parser.add_argument("--repeats", type=int, default=300, help="timed updates (default 300)")
    parser.add_argument(
        "--methods",
        type=csv_strs,
        default=["morphkv", "h2o", "tova", "streaming_llm", "random"],
        help="arm specs, comma separated (default morphkv,h2o,tova,streaming_llm,random)",
    )
    parser.add_argument("--grid", action="store_true", help="budgets x windows grid instead")
    parser.add_argument("--quick", action="store_true", help="tiny run for tests/CI")
    parser.add_argument("--out", default=None, help="output folder (default results/layer)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (grid only)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    """CLI entry point (``morphkv`` command contract): 0 on success."""
    require_matplotlib(args)
    if args.grid:
        run_grid_command(
            argparse.Namespace(**{**vars(args), "repeats": 0 if args.quick else args.repeats})
        )
        return 0
    if args.quick:
        args.budget, args.repeats = min(args.budget, 64), min(args.repeats, 20)
    result = {
        **run_methods(args.methods, args.budget, args.repeats, args.quiet),
        "environment": environment(),
    }
    cols = ["method", "decode_us", "rotating_us", "decode_ratio", "chunk2048_ms"]
    print(
        f"budget {args.budget}, B=1, {H} KV heads, head_dim {D}, float16, window 8, 4 sinks; "
        "decode_us: one single-token update once full; decode_ratio: vs RotatingKVCache"
    )
    print(markdown_table(cols, [[r[c] for c in cols] for r in result["rows"]]))
    folder = out_dir(args, NAME)
    path = write_json(folder / f"{NAME}{'_quick' if args.quick else ''}.json", result)
    if not args.no_plot:
        fig, axes = plots.panels(1, 7, 4.5)
        series = {k: [r[k] for r in result["rows"]] for k in ("decode_us", "rotating_us")}
        plots.grouped_bars(
            axes[0, 0], args.methods, series, f"decode update, budget {args.budget}, us"
        )
        axes[0, 0].legend(fontsize=7)
        plots.save(fig, folder / f"{NAME}.png", 100)
    print(f"wrote {path}")
    return 0
